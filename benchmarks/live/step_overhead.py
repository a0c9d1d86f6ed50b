"""What one more prefill step costs vLLM-CPU, beyond its tokens' work.

    .venv/bin/python benchmarks/live/step_overhead.py [--model-size tiny] [--blocks 8]
        [--repeats 5] [--rounds 2] [--out DIR]

The simulator charges each extra step end ``step_overhead_s`` (2 ms on an H100, an
estimate: ``lmcache_histate/sim/capture.py`` NOTE 2) and the interval choice prices it as
``σ`` = that time in tokens of prefill (``core/interval.py``). This measures the CPU
figure: one prompt of ``--blocks`` blocks, prefilled (one generated token, no prefix
cache) by an engine whose step budget is the whole prompt (one step) and by one whose
budget is one block (``--blocks`` steps). Then

    overhead per step = (T_small − T_whole) / (blocks − 1)
    σ = overhead per step / (T_whole / prompt tokens)

``T`` is the median over ``--repeats`` timed prompts after one warm-up, each prompt fresh
(other random tokens). The two engines run alternately, ``--rounds`` times each (ABAB), so
the machine's drift hits both; each in its own process. ``--out`` gets
``step_overhead.md`` (command, table, machine).

NOTE 1 (what this leaves in): a one-block step also runs its matmuls on fewer rows, so the
difference holds the lost efficiency as well as the fixed cost (scheduler pass, input
preparation, the sync that ends the step); on a GPU the split is different, which is why
the simulator keeps its estimate.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from marked_child import run_marked

HERE = Path(__file__).resolve().parent
MARK = "STEP_OVERHEAD "


def run_engine(size: str, blocks: int, one_block: bool, repeats: int, seed: int) -> None:
    """Time ``repeats`` fresh prompts in one engine; prints a JSON line."""
    from lmcache_histate.backends.demo.tiny_model import MODEL_SIZES, ensure_tiny_model
    from lmcache_histate.backends.vllm.engine_facts import probe
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model = ensure_tiny_model(**MODEL_SIZES[size])
    block = probe(model).block_size
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    length = blocks * block
    llm = LLM(model=str(model), dtype="bfloat16", seed=0, max_model_len=length + 64,
              max_num_seqs=1, enforce_eager=True, kv_cache_memory_bytes=64 << 20,
              enable_prefix_caching=False,
              max_num_batched_tokens=block if one_block else length)
    params = SamplingParams(max_tokens=1, temperature=0)
    rng = random.Random(seed)
    times = []
    for i in range(repeats + 1):
        prompt = [rng.randrange(4, vocab) for _ in range(length)]
        t0 = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        if i:  # the first is the warm-up
            times.append(time.perf_counter() - t0)
    print(MARK + json.dumps({"block": block, "tokens": length, "times": times}), flush=True)


def measure(size: str, blocks: int, one_block: bool, repeats: int, seed: int) -> dict[str, Any]:
    items, proc = run_marked(__file__, [
        "--engine", "one-block" if one_block else "whole", "--model-size", size,
        "--blocks", str(blocks), "--repeats", str(repeats), "--seed", str(seed)], MARK)
    if items:
        return items[0]
    raise RuntimeError(f"engine run failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-size", default="tiny")
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=HERE / "results-step-overhead")
    p.add_argument("--engine", choices=("whole", "one-block"), help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.blocks < 2:
        p.error("--blocks must be at least 2 (one step against several)")
    if args.engine:
        run_engine(args.model_size, args.blocks, args.engine == "one-block", args.repeats,
                   args.seed)
        return 0
    start = time.monotonic()
    runs: dict[bool, list[float]] = {False: [], True: []}
    rounds: dict[bool, list[float]] = {False: [], True: []}
    info: dict[str, Any] = {}
    for r in range(args.rounds):
        for one_block in (False, True):
            info = measure(args.model_size, args.blocks, one_block, args.repeats, seed=r)
            runs[one_block] += info["times"]
            rounds[one_block].append(statistics.median(info["times"]))
            print(f"  round {r + 1}, {'one-block' if one_block else 'whole'} budget: "
                  f"median {statistics.median(info['times']):.4f} s", flush=True)
    whole, small = statistics.median(runs[False]), statistics.median(runs[True])
    tokens, block = info["tokens"], info["block"]
    per_step = (small - whole) / (args.blocks - 1)
    sigma = per_step / (whole / tokens)
    command = ".venv/bin/python benchmarks/live/step_overhead.py " + " ".join(sys.argv[1:])
    text = "\n".join([
        "# One more prefill step on vLLM-CPU", "",
        f"Command: `{command.strip()}` ({time.monotonic() - start:.0f} s; "
        f"{platform.machine()}, {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d')}; "
        f"model size `{args.model_size}`, block {block}).", "",
        f"One {tokens}-token prompt, one generated token, no prefix cache; median of "
        f"{len(runs[False])} prompts per budget over {args.rounds} alternating rounds.", "",
        "| step budget | steps | prefill time (s) | round medians (s) |", "|---|---:|---:|---|",
        f"| {tokens} (whole prompt) | 1 | {whole:.4f} | "
        f"{', '.join(f'{t:.4f}' for t in rounds[False])} |",
        f"| {block} (one block) | {args.blocks} | {small:.4f} | "
        f"{', '.join(f'{t:.4f}' for t in rounds[True])} |", "",
        f"Overhead per extra step: **{per_step * 1e3:.1f} ms**; prefill per token "
        f"{whole / tokens * 1e6:.1f} µs; so σ = **{sigma:.0f} tokens** of prefill per step "
        f"end (the simulator's H100 estimate: 2 ms / 80 µs = 25 tokens).", "",
    ])
    print(text)
    page = args.out / "step_overhead.md"
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
