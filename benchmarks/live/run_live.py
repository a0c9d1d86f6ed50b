"""Live benchmark: vLLM's OpenAI server + HiState against vLLM and stock LMCache, side by side.

    .venv/bin/python benchmarks/live/run_live.py [--sessions 6] [--requests 8] [--repeats 2]

One invocation starts each stack (``stacks.py``) on the same tiny hybrid model, the same trace
and the same cache bytes, replays the workload with an agent-like client (``client.py``),
checks a sample of answers against a no-cache reference (greedy tokens and top-5 logprobs
must be equal), measures disk- and CPU-tier throughput beside the hardware's
(``io_check.py``) and writes ``live.md``, ``live.json`` and ``ttft_cdf.png`` to ``--out``.

NOTE 1 (what the guard can demand): a restored prefix determines the prefill's output, so the
first generated token and its top-k logprobs must equal those of the prefix computed from
zero, bit for bit, and so must every greedy token. Guard prompts taken from the replay itself
were seen to differ by up to 9.4e-4 in first-step logprobs (2026-12-01, HiState stack), where
their prefixes had been stored while other sessions shared the prefill batches; our reading is
that vLLM-CPU's numbers depend on the batch. So the guard uses fresh sessions (other synthetic
tokens) whose prefixes are computed alone, in every stack and in the reference. Later decode
steps' logprobs are reported
but do not fail the run: measured here, they differ by ~1e-3 between an engine with a KV
connector and one without even where the first step is identical (decode-path numerics).
See ``STRICT`` for vLLM's own prefix cache.

NOTE 2 (like with like): first-step logprobs can also depend on where the prefill steps end
(``forced_steps``: up to ~5e-2 on the ``production`` model with no cache at all). A stack
whose connector reports its steps (both connector stacks: ``HiStateConnector``'s
``histate_saves`` report) is compared with a reference that computes each guard prompt from
zero with the same step ends: below the restored hit those of the run that computed the
prefix (the seed, or an earlier guard prompt the seed itself hit), the check's own after it
(``client.like_steps``), forced by the reference's scheduler. With the same step ends the
reference does the restored run's arithmetic, so a difference is a restore error. The
comparison with vLLM's default steps is reported beside it (``default_steps``: what the step
ends alone change). The reference's cached tokens must be 0 in every run (a reset that did
not happen would make it compare a cache with itself). vLLM alone does not report its steps
and is compared with the default reference.

NOTE 3 (warm-up): every stack starts afresh for each repetition, and a fresh connector stack
pays one-time costs on its first requests: the server's first STORE maps vLLM's KV shared
memory and faults in L1 pages (measured: 88 ms against 6 ms for the next store), the first
lookup and plan open their channels. The replay's first requests are cold first turns
arriving together, so those costs would land on them, i.e. on first turns and p99. Like
``vllm bench serve --num-warmups``, each stack therefore serves two warm-up prompts before
the replay (``client.warm_up``): one of two blocks and ten tokens, then its two blocks with
another tail, which resumes from the stack's own store (vLLM's prefix cache is emptied after
each). No replay or guard prompt shares their first token, so they share no block with the
measured requests; their two KV chunks stay in the tiers as the oldest objects, the same in
both connector stacks.

NOTE 4 (CPU seconds): on a CPU host the engine, its workers and the cache server share the
same cores, so a second of CPU the cache server spends during the replay is a second the
prefill could not have (on this 2-core machine nearly one for one); with a GPU the engine's
prefill runs on the device and the server's CPU time costs it nothing. Each repetition
records the user + system CPU seconds of each stack's processes during its replay
(``stacks.Stack.cpu_seconds``: the API server and its descendants, the cache server and
its descendants), so a TTFT difference between the connector stacks can be set against
what each of their processes burned.

NOTE 5 (cold starts): the disk tiers recover the objects their folders hold when a server
starts (``disk.tier``; stock LMCache's tier is HiState's too, so both do), and the stacks'
folders live under ``--out``'s ``work/``. A second run into the same ``--out`` would start
every connector stack warm with the first run's objects, first turns hitting what no earlier
prompt of the replay stored (a re-run into a kept ``--out`` hit 29 % more tokens than
reachable). So ``run`` empties ``work/`` first, and checks each replay request by request
(``warm_start_hits``): a stack that resumed more of a prompt than it shares with any other
prompt of the workload (``shareable_hit_tokens``: in any order, as concurrent sessions
arrive) did not start cold, and the run stops there.

NOTE 6 (counters that reconcile): after each replay the run reads vLLM's
``vllm:external_prefix_cache_hits_total`` and, with a HiState server, its
``histate_loaded_tokens_total`` (``stacks.Stack.token_counters``). Both count the tokens a
request's first load wrote into vLLM's blocks, so they must be equal; the page says so or
names the repetitions where they are not (``unreconciled``). The server's lookup series is
an estimate (it counts what the server found, not what vLLM took: ``metrics`` NOTE 1) and is
shown as one.

Workload: the bundled Weka Claude Code sample (``--trace`` for another folder of Weka files),
each 64-token trace block becoming ``--block-tokens`` synthetic tokens (the demo's replay:
prefix structure kept exactly). Memory: the engine's KV pool (``--gpu-pool-mib``) is the same
everywhere; CPU and disk tiers each get ``--cache-fraction`` of what a state-per-chunk cache of
the workload needs at this machine's engine layout, so the working set does not fit. With
``--repeats 2`` the stacks run in ABBA order and each request's TTFT is the median of its runs
(the machine's drift hits every stack alike).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import re
import shlex
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import client
import io_check
import stacks
from lmcache_histate.backends.demo.tiny_model import MODEL_SIZES

GUARD_TOP = 5
GUARD_TOKENS = 4


def guard_mismatches(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> dict[str, Any]:
    """Where a stack's answers differ from the reference's (token ids as keys, NOTE 1).

    ``first``: prompts whose first generated token or its top-k logprobs differ -- the
    prefill's output, i.e. what a restored prefix (KV + recurrent state) determines; the run
    fails on any. ``tokens``: prompts whose greedy tokens differ at any step. ``later``:
    prompts whose later decode steps' logprobs differ while tokens agree (reported only:
    decode numerics also depend on the engine's configuration, e.g. a KV connector).
    """
    first, tokens, later = [], [], []
    delta = 0.0
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if a["tokens"][:1] != b["tokens"][:1] or a["top_logprobs"][:1] != b["top_logprobs"][:1]:
            first.append(i)
            x, y = a["top_logprobs"][0], b["top_logprobs"][0]
            delta = max([delta, *(abs(x[t] - y[t]) for t in x.keys() & y.keys())])
        if a["tokens"] != b["tokens"]:
            tokens.append(i)
        elif a["top_logprobs"] != b["top_logprobs"]:
            later.append(i)
    return {"first": first, "tokens": tokens, "later": later, "first_max_delta": delta}


def like_step_ends(answers: list[dict[str, Any]]) -> list[list[int]] | None:
    """Per guard prompt, the step ends a from-zero reference needs to do what the stack did
    (``client.like_steps``); None when the stack did not report its steps (NOTE 2)."""
    if not answers or any(a["like_step_ends"] is None for a in answers):
        return None
    return [a["like_step_ends"] for a in answers]


STRICT = ("lmcache", "histate", "histate-final")
"""Stacks whose hits are restores through the KV connector at chunk boundaries: their first
step must be bit-identical (NOTE 1). vLLM's own prefix cache on CPU resumes where its retained
state is, and its first-step logprobs were measured to differ slightly from recompute; that is
reported with its largest difference, and fails the run only if a greedy token differs."""


def _pct(values: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(values, q)) if values else float("nan")


def summarize(rows: list[dict[str, Any]], sensitive: set[int]) -> dict[str, Any]:
    ttft = [r["ttft_s"] for r in rows]
    sens = [r["ttft_s"] for i, r in enumerate(rows) if i in sensitive]
    # First turns: nothing of the session is cached anywhere, so no cache can help them;
    # what a stack adds there is its own cost (and the queue the other sessions make).
    first = [r["ttft_s"] for r in rows if r["turn"] == 0]
    prompt = sum(r["prompt_tokens"] for r in rows)
    cached = sum(r["cached_tokens"] for r in rows)
    return {
        "cached_tokens": cached, "prompt_tokens": prompt, "hit_rate": cached / max(prompt, 1),
        "mean_s": statistics.fmean(ttft), "p50_s": _pct(ttft, 50), "p95_s": _pct(ttft, 95),
        "p99_s": _pct(ttft, 99),
        "sensitive_mean_s": statistics.fmean(sens) if sens else float("nan"),
        "sensitive_p99_s": _pct(sens, 99),
        "first_turns": len(first),
        "first_turns_mean_s": statistics.fmean(first) if first else float("nan"),
    }


def reuse_sensitive(per_stack: dict[str, list[dict[str, Any]]], chunk: int) -> set[int]:
    """Requests whose cached tokens differ by at least one chunk between stacks: the ones
    where the caching policy, not the model, decides the TTFT."""
    runs = list(per_stack.values())
    return {i for i in range(len(runs[0]))
            if max(r[i]["cached_tokens"] for r in runs) - min(r[i]["cached_tokens"] for r in runs)
            >= chunk}


def _plot(per_stack: dict[str, list[dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, rows in per_stack.items():
        xs = sorted(r["ttft_s"] for r in rows)
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post",
                label=stacks.TITLES[key])
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _median_rows(runs: list[list[client.Row]]) -> list[dict[str, Any]]:
    out = []
    for same in zip(*runs, strict=True):
        out.append({"session": same[0].session, "turn": same[0].turn,
                    "prompt_tokens": same[0].prompt_tokens,
                    "cached_tokens": round(statistics.median(r.cached_tokens for r in same)),
                    "ttft_s": statistics.median(r.ttft_s for r in same)})
    return out


def fresh_work(out: Path) -> Path:
    """``out/work`` emptied: the stacks' scratch folders of an earlier run gone (NOTE 5)."""
    work = out / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    return work


def warm_start_hits(rows: list[client.Row], shareable: dict[tuple[str, int], int]) -> list[str]:
    """The requests of one replay that resumed more tokens than they share with any other
    prompt of the workload (``shareable``: ``shareable_hit_tokens`` by session and turn), as
    ``session/turn: hit > shareable``; empty for a stack that started cold (NOTE 5)."""
    return [f"{r.session}/{r.turn}: {r.cached_tokens} > {shareable[(r.session, r.turn)]}"
            for r in rows if r.cached_tokens > shareable[(r.session, r.turn)]]


def run(args: argparse.Namespace) -> dict[str, Any]:
    from lmcache_histate.backends.demo.engine_proc import ENGINE_DTYPE
    from lmcache_histate.backends.demo.tiny_model import ensure_tiny_model, size_overrides
    from lmcache_histate.backends.demo.workload import (
        LO_TOKEN,
        build_workload,
        reachable_hit_tokens,
        shareable_hit_tokens,
        unique_chunks,
    )
    from lmcache_histate.backends.vllm.engine_facts import probe

    out = Path(args.out).resolve()  # servers run in their own working directories
    work = fresh_work(out)  # NOTE 5
    model = ensure_tiny_model(**size_overrides(args.model_size))
    layout = probe(model, dtype=ENGINE_DTYPE)
    chunk = layout.block_size
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    workload = build_workload(sessions=args.sessions, requests=args.requests,
                              block_tokens=args.block_tokens,
                              max_prompt_tokens=args.max_model_len - 8, vocab=vocab,
                              trace_dir=Path(args.trace) if args.trace else None)
    footprint = unique_chunks(workload, chunk) * layout.state_per_chunk_bytes()
    reachable = sum(reachable_hit_tokens(workload, chunk))
    shareable = {(r.session, r.turn): n
                 for r, n in zip(workload, shareable_hit_tokens(workload, chunk), strict=True)}
    tier = max(int(args.cache_fraction * footprint), 4 << 20)
    budget = stacks.Budget(args.gpu_pool_mib << 20, tier, tier)
    print(f"engine layout: {layout.describe()}\nworkload: {len(workload)} requests, "
          f"footprint {footprint / 1e6:.1f} MB; budget per stack: KV pool "
          f"{args.gpu_pool_mib} MiB, CPU {tier / 1e6:.1f} MB, disk {tier / 1e6:.1f} MB",
          flush=True)
    keys = [k for k in stacks.STACKS if k in args.stacks.split(",")]
    order = [keys if rep % 2 == 0 else keys[::-1] for rep in range(args.repeats)]
    runs: dict[str, list[list[client.Row]]] = {k: [] for k in keys}
    priced: dict[str, list[dict[str, Any]]] = {k: [] for k in keys if k == "histate"}
    cpu: dict[str, list[dict[str, float]]] = {k: [] for k in keys}  # NOTE 4
    counted: dict[str, list[dict[str, float | None]]] = {k: [] for k in keys}  # NOTE 6
    errors: dict[str, str] = {}
    guard: dict[str, Any] = {}
    # Guard prompts: sessions of the same trace with other synthetic tokens (seed + 1), so
    # their prefixes are computed alone, never inside a replay batch (NOTE 1).
    fresh = build_workload(sessions=args.sessions, requests=2, block_tokens=args.block_tokens,
                           max_prompt_tokens=args.max_model_len - 8, vocab=vocab, seed=1,
                           trace_dir=Path(args.trace) if args.trace else None)
    turns = {(r.session, r.turn): r.prompt for r in fresh}
    sample = [(turns[(s, 0)], p) for (s, t), p in turns.items() if t == 1 and (s, 0) in turns]
    sample = sample[: args.guard_sample]
    warm = client.warm_up_prompts([*(r.prompt for r in workload), *(r.prompt for r in fresh)],
                                  block=chunk, vocab=vocab, lo=LO_TOKEN)  # NOTE 3
    done = 0
    total = len(workload) * len(keys) * args.repeats

    def tick() -> None:
        nonlocal done
        done += 1
        if done % 10 == 0 or done == total:
            print(f"  {done}/{total} requests", flush=True)

    for rep, keys_in_order in enumerate(order):
        for key in keys_in_order:
            print(f"[rep {rep + 1}] {stacks.TITLES[key]}: starting", flush=True)
            try:
                with stacks.start_stack(key, model=model, layout=layout, budget=budget,
                                        work=work / f"rep{rep}", max_model_len=args.max_model_len,
                                        errors=errors) as stack:
                    client.warm_up(stack.base_url, warm)
                    before = stack.cpu_seconds()  # NOTE 4
                    rows = asyncio.run(client.replay(
                        stack.base_url, workload, concurrency=args.concurrency,
                        think_scale=args.think_scale, think_cap_s=args.think_cap, progress=tick))
                    cpu[key].append({k: v - before[k] for k, v in stack.cpu_seconds().items()})
                    counted[key].append(stack.token_counters())  # NOTE 6
                    warm_hits = warm_start_hits(rows, shareable)
                    if warm_hits:  # NOTE 5
                        raise RuntimeError(
                            f"{stacks.TITLES[key]} did not start cold: it resumed more than "
                            f"the workload's other prompts share ({', '.join(warm_hits[:3])})")
                    runs[key].append(rows)
                    if stack.server is not None and key == "histate":
                        priced[key].append(plan_inputs(stack.server.get("/status")))
                    if rep == 0:
                        guard[key] = asyncio.run(client.greedy_logprobs(
                            stack.base_url, sample, max_tokens=GUARD_TOKENS, top=GUARD_TOP,
                            reset=key in STRICT))
            except stacks.StackError as exc:
                print(f"  {key} did not start: {exc}", flush=True)
                runs.pop(key, None)
    with stacks.start_stack("reference", model=model, layout=layout, budget=budget,
                            work=work / "ref", max_model_len=args.max_model_len,
                            errors=errors) as ref:
        reference = asyncio.run(client.greedy_logprobs(ref.base_url, sample, reset=True,
                                                       max_tokens=GUARD_TOKENS, top=GUARD_TOP))
        # NOTE 2: per stack that reported its steps, the same prompts with its step ends.
        like: dict[str, list[dict[str, Any]]] = {}
        for key, answers in guard.items():
            ends = like_step_ends(answers)
            if ends is not None:
                like[key] = asyncio.run(client.greedy_logprobs(
                    ref.base_url, sample, reset=True, max_tokens=GUARD_TOKENS, top=GUARD_TOP,
                    step_ends=ends))
    if any(r["cached_tokens"] for r in [*reference, *(x for v in like.values() for x in v)]):
        raise RuntimeError("the reference reused a prefix: its cache reset did not happen")
    mismatches = {k: guard_mismatches(v, like.get(k, reference)) for k, v in guard.items()}
    for key in like:  # what the step ends alone change: reported, never a failure
        mismatches[key]["default_steps"] = guard_mismatches(guard[key], reference)
    rows_of = {k: [[dataclasses.asdict(r) for r in rows] for rows in v]
               for k, v in runs.items() if v}
    per_stack = {k: _median_rows(v) for k, v in runs.items() if v}
    sensitive = reuse_sensitive(per_stack, chunk)
    summary = {k: summarize(v, sensitive) for k, v in per_stack.items()}
    # Each repetition on its own, over the same reuse-sensitive requests: the spread that a
    # difference between stacks must exceed (the medians above hide it).
    repetitions = {k: [summarize(rows, sensitive) for rows in v] for k, v in rows_of.items()}
    refused = {k: [l1_refused_objects(work / f"rep{rep}" / f"{k}-server.log")
                   for rep in range(args.repeats)]
               for k in rows_of if k in ("lmcache", "histate", "histate-final")}
    io = io_check.measure(work, args.io_mb)
    _plot(per_stack, out / "ttft_cdf.png")
    return {"model_size": args.model_size, "layout": layout.__dict__, "budget": budget.__dict__,
            "footprint": footprint,
            "requests": len(workload), "reachable_tokens": reachable,
            "shareable_tokens": sum(shareable.values()),
            "sensitive": sorted(sensitive), "summary": summary,
            "repetitions": repetitions, "rows": per_stack,
            "runs": rows_of,
            "errors": errors, "guard_mismatches": mismatches,
            "guard": guard, "guard_reference": reference, "guard_reference_like": like,
            "guard_sample": len(sample), "io": io, "l1_refused": refused,
            "cpu_seconds": {k: v for k, v in cpu.items() if v},
            "token_counters": {k: v for k, v in counted.items() if v},
            "plan_inputs": {k: v for k, v in priced.items() if v}}


def plan_inputs(status: dict[str, Any]) -> dict[str, Any]:
    """What HiState's plans were priced with at the end of a repetition (the server's
    ``GET /status``): the step price ``σ`` the engine's scheduler measured and sent (tokens
    of prefill per step end; None: never sent), the step grid, and the share of accesses
    that continue a session from its end (``core/interval.py`` NOTE 3 weighs interior
    states by one minus it)."""
    histate = status.get("histate") or {}
    return {k: histate.get(k) for k in ("step_price", "step_tokens", "end_probability")}


REFUSED = re.compile(r"Failed to batched allocate (\d+) memory blocks")


def l1_refused_objects(server_log: Path) -> int:
    """Objects of STOREs that LMCache dropped because L1 had no room for them.

    lmcache 0.5.6 allocates a STORE's objects as one batch and drops the whole batch when
    L1's free list cannot hold it (``memory_management.py``: the warning counted here;
    ``distributed/storage_manager.reserve_write`` then stores nothing of it); its eviction
    loop makes room only once a second, above the watermark
    (``storage_controllers/eviction_controller.eviction_loop``). A dropped object is a
    chunk or snapshot a later request cannot hit."""
    if not server_log.exists():
        return 0
    text = server_log.read_text(errors="replace")
    return sum(int(n) for n in REFUSED.findall(text))


SPREAD_COLUMNS = (("cached_tokens", "hit tokens", ",.0f"), ("mean_s", "TTFT mean (s)", ".3f"),
                  ("p99_s", "p99 (s)", ".3f"),
                  ("sensitive_mean_s", "reuse-sensitive mean (s)", ".3f"),
                  ("first_turns_mean_s", "first turns mean (s)", ".3f"))
"""The columns of ``spread_table``: (statistic of ``summarize``, heading, format)."""


def spread(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max) of one statistic over the repetitions."""
    return statistics.median(values), min(values), max(values)


def versus(ours: list[float], theirs: list[float]) -> str:
    """``lower`` / ``higher`` where every repetition of ``ours`` lies below / above every
    repetition of ``theirs`` (the ranges do not touch), else ``tie``: a rank only beyond
    the spread."""
    if max(ours) < min(theirs):
        return "lower"
    if min(ours) > max(theirs):
        return "higher"
    return "tie"


def spread_table(data: dict[str, Any]) -> list[str]:
    """Markdown table: per stack, each statistic computed on every repetition on its own
    (p99 is each repetition's p99 over its own requests), shown as median [min – max] of
    those; the last column ranks the stack's mean and p99 against HiState's only beyond the
    spread (``versus``)."""
    reps = data["repetitions"]
    head = "| stack | " + " | ".join(h for _, h, _ in SPREAD_COLUMNS)
    lines = [head + " | mean / p99 vs HiState |",
             "|---|" + "---:|" * len(SPREAD_COLUMNS) + "---|"]
    hs = reps.get("histate")
    for key, rs in reps.items():
        cells = []
        for name, _, fmt in SPREAD_COLUMNS:
            mid, lo, hi = spread([r[name] for r in rs])
            cells.append(f"{mid:{fmt}} [{lo:{fmt}} – {hi:{fmt}}]")
        rank = ("-" if key == "histate" or not hs else " / ".join(
            versus([r[n] for r in rs], [r[n] for r in hs]) for n in ("mean_s", "p99_s")))
        lines.append(f"| {stacks.TITLES[key]} | " + " | ".join(cells) + f" | {rank} |")
    return lines


def runs_lines(keys: list[str]) -> list[str]:
    """What each row runs (server, connector, scheduler): ``stacks.RUNS``."""
    return ["", "What each row runs:", "",
            *(f"* {stacks.TITLES[k]}: {stacks.RUNS[k]}" for k in keys)]


def reachable_line(data: dict[str, Any]) -> list[str]:
    """The hit tokens no stack can exceed (``workload.reachable_hit_tokens``), beside the
    prompt tokens: where stacks reach it, hits cannot tell their policies apart."""
    if "reachable_tokens" not in data:  # the earliest records (AVX2) did not count them
        return []
    reach, share = data["reachable_tokens"], data.get("shareable_tokens", 0)
    prompt = next(iter(data["summary"].values()))["prompt_tokens"]
    # Concurrent sessions may arrive out of workload order (NOTE 5): say so where it matters.
    order = (f" In another arrival order of the concurrent sessions up to {share:,}."
             if share > reach else "")
    return ["", f"Reachable hit tokens (a cache that never evicts and has a state at every "
                f"block boundary of every earlier prompt): {reach:,} of {prompt:,} prompt "
                f"tokens ({100 * reach / max(prompt, 1):.1f} %).{order}"]


def markdown(data: dict[str, Any], command: str) -> str:
    lay, b = data["layout"], data["budget"]
    lines = [
        f"# Live benchmark (`vllm serve` stacks, {data['model_size']} hybrid model, CPU)", "",
        f"Command: `{command}`", "",
        f"CPU {lay['isa']} ({lay['kernel_library']}), vLLM {lay['vllm_version']}, block size "
        f"{lay['block_size']}, state dtypes {'/'.join(lay['state_dtypes'])}. "
        f"{data['requests']} requests; state-per-chunk footprint "
        f"{data['footprint'] / 1e6:.1f} MB. Every stack: KV pool {b['gpu_pool_bytes'] >> 20} MiB; "
        f"stacks with the tier: CPU {b['cpu_bytes'] / 1e6:.1f} MB, disk "
        f"{b['disk_bytes'] / 1e6:.1f} MB. Reuse-sensitive: {len(data['sensitive'])} requests.",
        *reachable_line(data),
    ]
    reps = data.get("repetitions", {})
    if reps:
        lines += ["", f"Each statistic on each of the {len(next(iter(reps.values())))} "
                  "repetitions on its own (p99: a repetition's own p99), as median [min – "
                  "max] of those; a stack ranks against HiState only where the ranges do "
                  "not touch (`versus`), else `tie`:", "", *spread_table(data)]
    lines += ["", "Per-request medians: each request's TTFT is the median of its repetitions "
              "and each statistic is taken over those medians (a p99 of medians can sit below "
              "every repetition's own p99: rank stacks by the table above).", "",
              "| stack | hit tokens | TTFT mean (s) | p50 | p95 | p99 | reuse-sensitive mean | "
              "reuse-sensitive p99 | first turns mean |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for key, s in data["summary"].items():
        lines.append(
            f"| {stacks.TITLES[key]} | {s['cached_tokens']:,} ({100 * s['hit_rate']:.1f} %) | "
            f"{s['mean_s']:.3f} | {s['p50_s']:.3f} | {s['p95_s']:.3f} | {s['p99_s']:.3f} | "
            f"{s['sensitive_mean_s']:.3f} | {s['sensitive_p99_s']:.3f} | "
            f"{s['first_turns_mean_s']:.3f} |")
    lines += runs_lines(list(data["summary"]))
    if reps:
        lines += ["", "Per repetition (run order in the command's ABBA sequence), each "
                  "`rep 1 / rep 2 / ...`:", "",
                  "| stack | hit tokens | TTFT mean (s) | p99 | reuse-sensitive mean | "
                  "first turns mean |", "|---|---|---|---|---|---|"]
        for key, rs in reps.items():
            def each(name: str, fmt: str, rs: list[dict[str, Any]] = rs) -> str:
                return " / ".join(format(r[name], fmt) for r in rs)
            lines.append(
                f"| {stacks.TITLES[key]} | {each('cached_tokens', ',')} | "
                f"{each('mean_s', '.3f')} | {each('p99_s', '.3f')} | "
                f"{each('sensitive_mean_s', '.3f')} | {each('first_turns_mean_s', '.3f')} |")
    lines += ["", f"Correctness guard ({data['guard_sample']} prompts, {GUARD_TOKENS} greedy "
              f"tokens with top-{GUARD_TOP} logprobs, against the same prompts computed from "
              "zero with the stack's own prefill step ends where it reports them, else vLLM's "
              "default steps; `run_live.py` NOTE 2): prompts whose first token or its logprobs "
              "differ (fails the run) / whose greedy tokens differ / whose later decode "
              "logprobs differ; then the same against vLLM's default steps:", ""]
    lines += [f"* {stacks.TITLES[k]} (hits {sum(g['cached_tokens'] for g in data['guard'][k])}"
              f" tokens; reference with {'its' if 'default_steps' in v else 'default'} "
              f"step ends): {_guard_cell(v)}"
              + (f"; default steps: {_guard_cell(v['default_steps'])}" if "default_steps" in v
                 else "") for k, v in data["guard_mismatches"].items()]
    if data.get("l1_refused"):
        lines += ["", "Objects of STOREs that LMCache dropped for lack of room in L1 "
                  "(`l1_refused_objects`), per repetition: " + "; ".join(
                      f"{stacks.TITLES[k]} {' / '.join(str(n) for n in v)}"
                      for k, v in data["l1_refused"].items()) + "."]
    if data.get("cpu_seconds"):
        lines += ["", "CPU seconds used during each replay (NOTE 4; engine = `vllm serve` and "
                  "its EngineCore, server = the LMCache server), per repetition: " + "; ".join(
                      f"{stacks.TITLES[k]} engine "
                      + " / ".join(f"{r['engine']:.1f}" for r in v)
                      + (", server " + " / ".join(f"{r['server']:.1f}" for r in v)
                         if any(r["server"] for r in v) else "")
                      for k, v in data["cpu_seconds"].items()) + "."]
    if data.get("token_counters"):
        lines += ["", counters_line(data["token_counters"])]
    for key, rs in data.get("plan_inputs", {}).items():
        lines += ["", f"{stacks.TITLES[key]}: plans priced at a measured step price of "
                  + " / ".join("none" if r["step_price"] is None else f"{r['step_price']:.1f}"
                               for r in rs)
                  + " tokens per step end on a grid of "
                  + " / ".join(str(r["step_tokens"]) for r in rs)
                  + " tokens, end probability "
                  + " / ".join("-" if r["end_probability"] is None
                               else f"{r['end_probability']:.3f}" for r in rs)
                  + " (per repetition, at its end)."]
    if data["errors"]:
        lines += ["", "Refused at start (verbatim):", ""]
        lines += [f"* {k}: `{v}`" for k, v in data["errors"].items()]
    lines += ["", "I/O next to the hardware (same run):", "", io_check.markdown(data["io"]), "",
              "![TTFT CDF](ttft_cdf.png)", ""]
    return "\n".join(lines)


def unreconciled(counted: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Repetitions whose HiState server counted other loaded tokens than vLLM's external
    hits (NOTE 6), as ``stack rep N: loaded != external``; empty when all agree."""
    return [f"{k} rep {i + 1}: {c['loaded']:.0f} != {c['vllm_external_hits']:.0f}"
            for k, reps in counted.items() for i, c in enumerate(reps)
            if c["loaded"] is not None and c["loaded"] != c["vllm_external_hits"]]


def counters_line(counted: dict[str, list[dict[str, Any]]]) -> str:
    """The markdown line of NOTE 6: per stack and repetition, vLLM's external hits beside
    the HiState server's loaded tokens (and its lookups' estimate)."""
    def cell(c: dict[str, Any]) -> str:
        own = ("" if c["loaded"] is None else
               f" = loaded {c['loaded']:,.0f} (lookups found {c['found_estimate']:,.0f}, "
               "an estimate)")
        return f"{c['vllm_external_hits']:,.0f}{own}"

    bad = unreconciled(counted)
    return ("Tokens vLLM took from the connector (`vllm:external_prefix_cache_hits_total`, "
            "after warm-up and replay) beside the HiState server's "
            "`histate_loaded_tokens_total`, per repetition (NOTE 6): " + "; ".join(
                f"{stacks.TITLES[k]} " + " / ".join(cell(c) for c in reps)
                for k, reps in counted.items())
            + (f". NOT RECONCILED: {', '.join(bad)}." if bad else "; they agree."))


def _guard_cell(v: dict[str, Any]) -> str:
    return (f"{v['first'] or 'none'} / {v['tokens'] or 'none'} / {v['later'] or 'none'}"
            + (f" (largest first-step difference {v['first_max_delta']:.2e})" if v["first"]
               else ""))


def load(out: Path) -> dict[str, Any]:
    """``out/live.json`` with the per-repetition statistics recomputed from its per-request
    records (``runs``) by today's ``summarize``."""
    data = json.loads((out / "live.json").read_text())
    data["repetitions"] = {k: [summarize(rows, set(data["sensitive"])) for rows in reps]
                           for k, reps in data["runs"].items()}
    data.setdefault("model_size", "tiny")
    return data


def rendered(out: Path) -> str:
    """What ``out/live.md`` says when written from ``out/live.json`` (``load``) by today's
    ``markdown``, with the command line the page already names: no stack is run."""
    old = (out / "live.md").read_text()
    command = re.search(r"^Command: `(.*)`$", old, re.M)
    if command is None:
        raise SystemExit(f"{out / 'live.md'}: no `Command:` line to keep")
    data = load(out)
    return markdown(data, command.group(1)) + f"\nWall time {data['wall_s']:.0f} s.\n"


def render(out: Path) -> str:
    """``out/live.md`` written again (``rendered``)."""
    text = rendered(out)
    (out / "live.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--render", metavar="DIR",
                   help="only write DIR/live.md again from DIR/live.json (its per-request "
                        "records), with today's tables; runs nothing")
    p.add_argument("--model-size", choices=list(MODEL_SIZES), default="tiny",
                   help="random-weight hybrid model: tiny, or production (Qwen3.5-9B's "
                        "per-layer shapes and ratios, backends/demo/tiny_model.py)")
    p.add_argument("--sessions", type=int, default=6)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--block-tokens", type=int, default=8)
    p.add_argument("--trace", help="folder of Weka trace files (default: the bundled sample)")
    p.add_argument("--concurrency", type=int, default=6, help="sessions active at once")
    p.add_argument("--think-scale", type=float, default=0.05)
    p.add_argument("--think-cap", type=float, default=2.0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--gpu-pool-mib", type=int, default=5,
                   help="vLLM's KV pool in every stack (small: the GPU of an agent server "
                        "cannot keep the sessions between turns; vLLM prints its size in "
                        "tokens, ~7K for the tiny model at 5 MiB)")
    p.add_argument("--cache-fraction", type=float, default=0.5)
    p.add_argument("--max-model-len", type=int, default=4608)
    p.add_argument("--guard-sample", type=int, default=4)
    p.add_argument("--io-mb", type=int, default=400,
                   help="MB written per object size by the I/O check (default 400)")
    p.add_argument("--stacks", default=",".join(stacks.DEFAULT_STACKS),
                   help=f"comma-separated, of {', '.join(stacks.STACKS)}")
    p.add_argument("--out", default="benchmarks/live/results")
    args = p.parse_args(argv)
    if args.render:
        print(render(Path(args.render)))
        return 0
    started = time.monotonic()
    data = run(args)
    out = Path(args.out)
    command = shlex.join([".venv/bin/python", "benchmarks/live/run_live.py",
                          *(argv if argv is not None else sys.argv[1:])])
    data["wall_s"] = time.monotonic() - started
    (out / "live.json").write_text(json.dumps(data, indent=1, default=str))
    text = markdown(data, command) + f"\nWall time {data['wall_s']:.0f} s.\n"
    (out / "live.md").write_text(text)
    print(text)
    bad = {k: v for k, v in data["guard_mismatches"].items()
           if v["tokens"] or (k in STRICT and v["first"])}
    if bad:
        print(f"correctness guard FAILED: {bad}", file=sys.stderr)
    apart = unreconciled(data["token_counters"])  # NOTE 6
    if apart:
        print(f"token counters NOT reconciled: {apart}", file=sys.stderr)
    return 1 if bad or apart else 0


if __name__ == "__main__":
    sys.exit(main())
