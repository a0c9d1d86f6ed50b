"""Simulator speed: one policy over a whole trace folder (default: the shared Weka set).

Times trace loading and the replay separately and prints requests/s. The issue's target
is one policy over the whole shared Weka folder (360 files, ~24K requests, 5.8M chunk
hashes at 528 tokens) in under 5 minutes on the 2-core development machine.

Usage: ``python benchmarks/sim_speed.py [--trace DIR] [--policy histate] [--profile N]``
(``--profile N`` prints the N most expensive functions by own time, via cProfile).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from pathlib import Path

from lmcache_histate.sim.config import SimSetup
from lmcache_histate.sim.runner import load_sim_trace, policy_factories
from lmcache_histate.sim.server import simulate

DEFAULT_TRACE = Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "weka-cc"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--policy", default="histate")
    ap.add_argument("--max-input-tokens", type=int, default=None)
    ap.add_argument("--profile", type=int, default=0, metavar="N")
    args = ap.parse_args()

    setup = SimSetup.paper()
    t0 = time.perf_counter()
    trace = load_sim_trace(args.trace, setup, args.max_input_tokens)
    t_load = time.perf_counter() - t0
    hashes = sum(len(r.chunk_hashes) for s in trace.sessions for r in s.requests)
    policy = policy_factories(setup)[args.policy]()
    prof = cProfile.Profile() if args.profile else None
    t1 = time.perf_counter()
    if prof is not None:
        prof.enable()
    run = simulate(trace, policy, setup)
    if prof is not None:
        prof.disable()
    t_sim = time.perf_counter() - t1
    n = len(run.results)
    print(f"trace {trace.name}: {len(trace.sessions)} sessions, {n} requests, "
          f"{hashes:,} chunk hashes at {setup.chunk_tokens} tokens")
    print(f"policy {args.policy}: load {t_load:.1f} s, replay {t_sim:.1f} s "
          f"({n / t_sim:,.0f} requests/s, {hashes / t_sim:,.0f} chunks/s), "
          f"total {t_load + t_sim:.1f} s")
    if prof is not None:
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)


if __name__ == "__main__":
    main()
