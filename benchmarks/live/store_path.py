"""Where a connector's time goes on prompts that hit nothing: TTFT side by side + a profile.

    .venv/bin/python benchmarks/live/store_path.py [--prompts 8] [--prompt-tokens 2048]
        [--repeats 2] [--model-size tiny|production] [--phases alone,queued] [--profile]
        [--out benchmarks/live/results-store-path]

The shared-folder live run (``benchmarks/README.md``) measured that first turns, which no
cache can help, are slower with a KV connector than in vLLM alone. This benchmark isolates
that cost. Each stack of ``stacks.py`` (``vllm``, ``lmcache``, ``histate``; same model, flags
and budgets as the live benchmark) serves the same fresh prompts (random tokens, nothing to
hit) in two phases:

* ``alone``  -- one prompt at a time: the connector's cost per request with an idle engine;
* ``queued`` -- all prompts at once (``--max-num-seqs 4`` of them run, the rest wait): how
  the cost grows behind a queue, as on an agent server.

A stack name with ``+vllm-reservation`` (e.g. ``histate+vllm-reservation``) runs that stack
with the OpenMP core reservation vLLM itself makes with a KV connector
(``VLLM_CPU_NUM_OF_RESERVED_CPU`` = 2 x ranks) instead of the one ``histate serve`` keeps
(``backends/vllm/cpu_binding.py``): side by side, this shows what that choice is worth.

With ``--profile`` (needs ``py-spy`` on PATH or in the venv: ``pip install py-spy``) the
vLLM process tree and the LMCache server are sampled during both phases, and the EngineCore's
samples are split into what its stack shows: the model's forward pass, the connector's
store and load paths, the scheduler, the rest. Only busy threads are sampled, so a share is
of the CPU time the process used, and a thread waiting on a lock does not count.

Beside the TTFTs it records what the load does not move: CPU seconds per prompt of the vLLM
processes and of the cache server, and vLLM's own account of each prompt's time waiting to be
scheduled and in prefill (``/metrics``). On a shared host those separate the stacks where
the TTFTs of two repetitions do not.

NOTE 1 (one prompt length per run): the live run's prompts were 1.9-4.6K tokens; the
default 2,048 keeps one run short. Every stack runs at the engine's default step budget
(``stacks.py``); HiState's scheduler ends a step early only at a planned snapshot, so the
per-step connector work (``save_kv_layer``/``wait_for_save`` on the worker, the STORE round
trip) is counted once per step vLLM takes anyway.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from lmcache_histate.backends.demo.tiny_model import MODEL_SIZES
from lmcache_histate.backends.vllm.cpu_binding import RESERVED_ENV

sys.path.insert(0, str(Path(__file__).resolve().parent))
import client
import stacks

# Categories of a main-thread sample of vLLM's engine processes (EngineCore, Worker),
# checked in this order against every frame of the stack: the first category whose pattern
# matches any frame wins. Idle samples are included (``--idle``): a share is of wall time.
CATEGORIES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("connector: store", re.compile(r"(save_kv_layer|wait_for_save|[Ss]tore)")),
    ("connector: load", re.compile(r"(start_load_kv|wait_for_layer_load|[Ll]ookup|retrieve)")),
    ("connector: other", re.compile(r"(lmcache|kv_connector|HiStateConnector)")),
    ("model forward", re.compile(r"model_executor")),
    ("scheduler", re.compile(r"v1/core/sched")),
    ("waiting (worker's reply / next request)",
     re.compile(r"(dequeue|acquire_read|Queue\.get|Condition\.wait)")),
)
VLLM_RESERVATION = "vllm-reservation"


def title(key: str) -> str:
    name, *variant = key.split("+")
    return stacks.TITLES[name] + (", vLLM's core reservation" if variant else "")


def fresh_prompts(n: int, tokens: int, vocab: int, seed: int) -> list[list[int]]:
    """Random prompts that share no block with each other or with any other run's."""
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(tokens)] for _ in range(n)]


async def _phase(base_url: str, prompts: list[list[int]], queued: bool) -> list[float]:
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=base_url, api_key="none", timeout=600.0,
                           max_retries=0) as api:
        if queued:
            done = await asyncio.gather(*(client.timed(api, p) for p in prompts))
        else:
            done = [await client.timed(api, p) for p in prompts]
    if any(cached for _, cached in done):
        raise RuntimeError("a fresh prompt hit a cache: the prompts are not fresh")
    return [ttft for ttft, _ in done]


def _py_spy() -> str | None:
    venv = Path(sys.executable).parent / "py-spy"
    return str(venv) if venv.exists() else shutil.which("py-spy")


class Sampler:
    """``py-spy record`` on one process (and its children), raw collapsed stacks."""

    def __init__(self, exe: str, pid: int, out: Path, rate: int, wall: bool) -> None:
        """``wall``: sample idle threads too, per thread (where wall time goes); otherwise
        only threads on a CPU (where CPU time goes)."""
        self.out = out
        self.proc = subprocess.Popen(
            [exe, "record", "--pid", str(pid), "--subprocesses", "--format", "raw",
             "--rate", str(rate), "--output", str(out), "--nonblocking",
             *(["--idle", "--threads"] if wall else [])],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )

    def stop(self) -> Counter[str]:
        self.proc.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        _, err = self.proc.communicate(timeout=60)
        if not self.out.exists():
            raise RuntimeError(f"py-spy wrote nothing: {err.decode(errors='replace')[-400:]}")
        stacks_seen: Counter[str] = Counter()
        for line in self.out.read_text(errors="replace").splitlines():
            stack, _, count = line.rpartition(" ")
            if stack and count.isdigit():
                stacks_seen[stack] += int(count)
        return stacks_seen


def _process_of(stack: str) -> str:
    """The innermost process of a sample, by its title (vLLM names its processes)."""
    roots = [f for f in stack.split(";") if f.startswith("process ")]
    if not roots:
        return "main"
    root = roots[-1]
    for name in ("EngineCore", "Worker"):
        if name in root:
            return name
    return root.split(":", 1)[-1].strip('"')[:60]


ENGINE_METRICS = {
    "queue_s": "vllm:request_queue_time_seconds_sum",
    "prefill_s": "vllm:request_prefill_time_seconds_sum",
}
"""What vLLM's /metrics says about the prompts, by our name: the summed seconds requests spent
waiting to be scheduled and in prefill (from their first scheduling to their first token).
Not its step count: the tokens-per-step histogram gets no sample for a step without output."""


def engine_counters(stack: stacks.Stack) -> dict[str, float]:
    """The current values of :data:`ENGINE_METRICS` (summed over label sets)."""
    values = dict.fromkeys(ENGINE_METRICS, 0.0)
    for line in stack.metrics().splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        for key, metric in ENGINE_METRICS.items():
            if name == metric:
                values[key] += float(line.rsplit(" ", 1)[1])
    return values


def engine_pids(api_pid: int) -> list[int]:
    """vLLM's EngineCore under the API server (its workers are sampled as its children)."""
    found = []
    for child in subprocess.run(["pgrep", "-P", str(api_pid)], capture_output=True,
                                text=True).stdout.split():
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace")
        if "EngineCore" in cmdline:
            found.append(int(child))
    if not found:
        raise RuntimeError(f"no EngineCore process under {api_pid}")
    return found


def split_profile(samples: Counter[str]) -> dict[str, Any]:
    """Samples per process; for the main threads of vLLM's engine processes (EngineCore and
    its Worker): category shares of wall time and the top frames (inclusive)."""
    per_process: Counter[str] = Counter()
    shares = {"EngineCore": Counter[str](), "Worker": Counter[str]()}
    functions = {"EngineCore": Counter[str](), "Worker": Counter[str]()}
    for stack, n in samples.items():
        proc = _process_of(stack)
        per_process[proc] += n
        frames = stack.split(";")
        main = [i for i, f in enumerate(frames) if f.startswith("thread (") and "MainThread" in f]
        if proc not in shares or not main:
            continue
        frames = frames[main[0] + 1:]
        for name, pattern in CATEGORIES:
            if any(pattern.search(f) for f in frames):
                shares[proc][name] += n
                break
        else:
            shares[proc]["other"] += n
        for f in set(frames):
            functions[proc][f] += n
    out: dict[str, Any] = {"processes": dict(per_process)}
    for proc, counts in shares.items():
        total = sum(counts.values())
        if total:
            out[proc] = {"samples": total,
                         "categories": {k: v / total for k, v in counts.most_common()},
                         "top": [(f, v / total) for f, v in functions[proc].most_common(25)]}
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from lmcache_histate.backends.demo.engine_proc import ENGINE_DTYPE
    from lmcache_histate.backends.demo.tiny_model import ensure_tiny_model, size_overrides
    from lmcache_histate.backends.vllm.engine_facts import probe

    out = Path(args.out).resolve()
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    spy = _py_spy() if args.profile else None
    if args.profile and spy is None:
        raise SystemExit("--profile needs py-spy: .venv/bin/pip install py-spy")
    model = ensure_tiny_model(**size_overrides(args.model_size))
    layout = probe(model, dtype=ENGINE_DTYPE)
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    budget = stacks.Budget(args.gpu_pool_mib << 20, args.tier_mb * 10**6, args.tier_mb * 10**6)
    keys = args.stacks.split(",")
    unknown = [k for k in keys if k.split("+")[0] not in ("vllm", "lmcache", "histate")
               or k.split("+")[1:] not in ([], [VLLM_RESERVATION])]
    if unknown:
        raise SystemExit(f"--stacks: unknown {unknown}; allowed vllm, lmcache, histate, each "
                         f"optionally with +{VLLM_RESERVATION}")
    order = [keys if rep % 2 == 0 else keys[::-1] for rep in range(args.repeats)]
    print(f"engine layout: {layout.describe()}; {args.prompts} fresh prompts of "
          f"{args.prompt_tokens} tokens per phase", flush=True)
    results: dict[str, dict[str, list[float]]] = {k: {"alone": [], "queued": []} for k in keys}
    engine: dict[str, dict[str, dict[str, float]]] = {
        k: {p: dict.fromkeys(ENGINE_METRICS, 0.0) for p in ("alone", "queued")} for k in keys}
    cpu: dict[str, dict[str, float]] = {k: {"vLLM": 0.0, "server": 0.0} for k in keys}
    profiles: dict[str, Counter[str]] = {k: Counter() for k in keys}
    server_profiles: dict[str, Counter[str]] = {k: Counter() for k in keys}
    errors: dict[str, str] = {}
    seed = 0
    for rep, keys_in_order in enumerate(order):
        for key in keys_in_order:
            print(f"[rep {rep + 1}] {title(key)}", flush=True)
            # vLLM's own reservation with a connector: 2 x ranks (ranks = 1 here).
            env = {RESERVED_ENV: "2"} if key.endswith(VLLM_RESERVATION) else None
            with stacks.start_stack(key.split("+")[0], model=model, layout=layout,
                                    budget=budget, work=work / f"rep{rep}-{key}",
                                    max_model_len=args.max_model_len, errors=errors,
                                    env=env) as stack:
                seed += 1
                asyncio.run(_phase(stack.base_url, fresh_prompts(1, 64, vocab, 10_000 + seed),
                                   queued=False))  # warm-up: first-request compilation
                samplers = []
                if spy is not None:
                    samplers += [("engine", Sampler(spy, pid, work / f"{key}-{rep}-{pid}.txt",
                                                    args.rate, wall=True))
                                 for pid in engine_pids(stack.api_pid)]
                    if stack.server is not None:
                        samplers.append(("server", Sampler(
                            spy, stack.server.proc.pid, work / f"{key}-{rep}-server.txt",
                            args.rate, wall=False)))
                    time.sleep(1.0)  # py-spy attaches
                cpu0 = stack.cpu_seconds()
                for phase in args.phases.split(","):
                    seed += 1
                    prompts = fresh_prompts(args.prompts, args.prompt_tokens, vocab, seed)
                    before = engine_counters(stack)
                    ttfts = asyncio.run(_phase(stack.base_url, prompts, phase == "queued"))
                    for name, value in engine_counters(stack).items():
                        engine[key][phase][name] += (value - before[name]) / len(prompts)
                    results[key][phase] += ttfts
                    print(f"  {phase}: mean TTFT {statistics.fmean(ttfts):.3f} s", flush=True)
                cpu1 = stack.cpu_seconds()
                cpu[key]["vLLM"] += cpu1["engine"] - cpu0["engine"]
                cpu[key]["server"] += cpu1["server"] - cpu0["server"]
                for which, sampler in samplers:
                    got = sampler.stop()
                    (profiles if which == "engine" else server_profiles)[key].update(got)
    return {
        "layout": layout.describe(), "budget": budget.__dict__,
        "prompts": args.prompts, "prompt_tokens": args.prompt_tokens,
        "ttft": results, "errors": errors, "repeats": args.repeats,
        "model_size": args.model_size,
        "engine_per_prompt": {k: {p: {n: v / args.repeats for n, v in c.items()}
                                  for p, c in per.items()} for k, per in engine.items()},
        "cpu_s_per_prompt": {k: {w: v / (2 * args.prompts * args.repeats) for w, v in c.items()}
                             for k, c in cpu.items()},
        "profile": {k: split_profile(v) for k, v in profiles.items() if v},
        "server_top": {k: _top_self(v) for k, v in server_profiles.items() if v},
    }


def _top_self(samples: Counter[str], n: int = 12) -> list[tuple[str, float]]:
    """Leaf frames (self time) of a process's samples, as shares."""
    leaves: Counter[str] = Counter()
    for stack, count in samples.items():
        leaves[stack.rsplit(";", 1)[-1]] += count
    total = sum(leaves.values())
    return [(f, c / total) for f, c in leaves.most_common(n)] if total else []


def markdown(data: dict[str, Any], command: str) -> str:
    ttft = data["ttft"]
    base = ttft.get("vllm")
    lines = [f"Command: `{command}`", "", f"Engine ({data['model_size']} model): "
             f"{data['layout']}. {data['prompts']} fresh "
             f"prompts of {data['prompt_tokens']} tokens per phase and repetition, "
             f"{data['repeats']} repetition(s) in ABBA order.", "",
             "| stack | alone: mean TTFT (s) | vs vLLM | per repetition | queued: mean TTFT (s) "
             "| max | vs vLLM | CPU s per prompt: vLLM | server |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for key, phases in ttft.items():
        alone, queued = (statistics.fmean(phases[k]) if phases[k] else float("nan")
                         for k in ("alone", "queued"))
        ra = alone / statistics.fmean(base["alone"]) if base and base["alone"] else float("nan")
        rq = (queued / statistics.fmean(base["queued"]) if base and base["queued"]
              else float("nan"))
        c = data["cpu_s_per_prompt"][key]
        n = max(1, len(phases["alone"]) // data["repeats"])
        reps = " / ".join(f"{statistics.fmean(phases['alone'][i:i + n]):.3f}"
                          for i in range(0, len(phases["alone"]), n))
        worst = max(phases["queued"], default=float("nan"))
        lines.append(f"| {title(key)} | {alone:.3f} | {ra:.2f}x | {reps} | {queued:.3f} | "
                     f"{worst:.3f} | "
                     f"{rq:.2f}x | {c['vLLM']:.3f} | "
                     f"{c['server']:.3f} |")
    if data.get("engine_per_prompt"):
        lines += ["", "vLLM's own account per prompt (`/metrics`): seconds waiting to be "
                  "scheduled, seconds from the first scheduling to the first token:", "",
                  "| stack | alone: queue (s) | prefill (s) | queued: queue (s) | prefill (s) |",
                  "|---|---:|---:|---:|---:|"]
    for key, per in data.get("engine_per_prompt", {}).items():
        cells = " | ".join(f"{per[p]['queue_s']:.3f} | {per[p]['prefill_s']:.3f}"
                           for p in ("alone", "queued"))
        lines.append(f"| {title(key)} | {cells} |")
    for key, prof in data["profile"].items():
        for proc in ("EngineCore", "Worker"):
            if proc not in prof:
                continue
            lines += ["", f"### {title(key)}: {proc} main thread, wall time "
                      f"({prof[proc]['samples']} samples)", "", "| where | share |", "|---|---:|"]
            lines += [f"| {k} | {v:.1%} |" for k, v in prof[proc]["categories"].items()]
    for key, top in data["server_top"].items():
        lines += ["", f"### {title(key)}: LMCache server, leaf frames of the samples py-spy "
                  "counted as running (its timed waits included)", ""]
        lines += [f"* {v:.1%} `{f}`" for f, v in top]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=8, help="fresh prompts per phase")
    p.add_argument("--model-size", choices=list(MODEL_SIZES), default="tiny",
                   help="random-weight hybrid model (backends/demo/tiny_model.py)")
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=2, help="ABBA repetitions")
    p.add_argument("--gpu-pool-mib", type=int, default=5)
    p.add_argument("--tier-mb", type=int, default=64, help="CPU and disk tier, MB each")
    p.add_argument("--max-model-len", type=int, default=4608)
    p.add_argument("--stacks", default="vllm,lmcache,histate")
    p.add_argument("--phases", default="alone,queued", help="alone, queued or both")
    p.add_argument("--profile", action="store_true", help="sample with py-spy")
    p.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    p.add_argument("--out", default="benchmarks/live/results-store-path")
    args = p.parse_args(argv)
    started = time.monotonic()
    data = run(args)
    data["wall_s"] = time.monotonic() - started
    data["load_average"] = os.getloadavg()
    out = Path(args.out)
    (out / "store_path.json").write_text(json.dumps(data, indent=1, default=str))
    command = shlex.join([".venv/bin/python", "benchmarks/live/store_path.py",
                          *(argv if argv is not None else sys.argv[1:])])
    text = markdown(data, command) + (f"\nWall time {data['wall_s']:.0f} s, load average at "
                                      f"the end {data['load_average'][0]:.1f}.\n")
    (out / "store_path.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
