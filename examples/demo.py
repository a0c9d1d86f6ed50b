"""The demo: HiState against stock LMCache on an agentic trace, live on this machine.

    .venv/bin/python examples/demo.py                      # = make demo, about 3 minutes
    .venv/bin/python examples/demo.py --sessions 2 --requests 3 --variants histate,lru

For three variants side by side (HiState; HiState with a state at every chunk; stock LMCache
LRU), with the same small CPU and disk tiers, it starts ``histate-server`` and a vLLM CPU
engine with
``HiStateConnector`` serving the tiny generated hybrid model, replays the bundled Claude Code
sample (5 sessions x 8 requests; every 64-token trace block becomes 8 tokens drawn from
(session, block hash), so prompts share exactly the prefixes of the trace), and prints per
request (each request goes to the three variants back to back, alternating their order) the
cached tokens and time to first token, then a summary and a HiState-vs-LRU line with a TTFT
ratio only where the hits differ, given with its spread over sessions (docs/demo.md).
Nothing is downloaded.

Options worth changing: ``--sessions`` / ``--requests`` (replay size), ``--cache-fraction``
(tier sizes as a fraction of what a state-per-chunk cache of the replay needs: lower = more
pressure), ``--gap`` (seconds between requests), ``--workdir`` (keep configs, logs and disk
tiers), ``--json FILE`` (all numbers). ``--help`` lists them all.

The demo's code is the package ``lmcache_histate.backends.demo`` (``workload``, ``runs``,
``report``); to replay your own prompts, start from ``runs.run_interleaved``.
"""

from __future__ import annotations

import signal
import sys

from lmcache_histate.backends.demo import main

if __name__ == "__main__":
    # SIGTERM unwinds like Ctrl-C: the demo stops its servers and engines on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    sys.exit(main())
