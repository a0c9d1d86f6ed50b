"""The main job: HiState end to end on this machine, against stock LMCache, on an agentic trace.

    .venv/bin/python -m lmcache_histate.backends.demo      (= make demo, examples/demo.py)

What it does, with nothing downloaded:

1. generates the tiny random-weight ``Qwen3NextForCausalLM`` (``tiny_model.ensure_tiny_model``:
   3 GatedDeltaNet layers + 1 full-attention layer, byte-level tokenizer trained locally);
2. builds a replay from the bundled Weka Claude Code sample (``sim.traces.sample_trace_dir``):
   a few sessions, their first requests, in arrival order (see *Workload* below);
3. runs it against each variant's own fresh server started with ``histate-server`` (the
   project's launcher around ``lmcache server``) and own fresh vLLM CPU engine (offline
   ``vllm.LLM`` in a child process, ``engine_proc``) with ``HiStateConnector``, all started
   first and then fed each request in turn, interleaved (``runs.run_interleaved`` NOTE 1):

   * **HiState**: ``policy: histate`` (HiState placement, unified eviction, disk tier) and the
     connector's interval-driven saves (recurrent state only at the boundaries the server's
     interval controller chooses, plus each request's final boundary);
   * **LMCache (LRU)**: the same launcher with ``policy: lru`` (``configs/lru-baseline.yaml``:
     LMCache's own LRU on the same CPU and disk tiers, every object written through to disk)
     and stock LMCache saves (``histate.interval_saves: false``: a recurrent state at every
     chunk, what LMCache MP stores by default);

   both with the same tier sizes, by default smaller than what the LRU run would store (the
   regime HiState is for: a cache smaller than the agents' working set);
4. prints, per request, the cached tokens and the measured time to first token (TTFT) of the
   runs, then a summary and a HiState-vs-LRU line that gives a TTFT ratio only with its
   spread over sessions, and none where the hits tie (``report.compare``).

Workload. Weka traces list one hash id per 64-token source block (equal ids = equal prefix).
Each source block becomes ``--block-tokens`` synthetic tokens (default 8, i.e. 1/8 of the
real length) drawn from a generator seeded by (session file, block hash id), so two prompts
share exactly as many leading blocks as in the trace (prefix sharing, rewrites, subagents'
own scopes) while a 20K-token Claude Code context becomes ~2.5K tokens. The partial last
block and a prompt's tail beyond its hashed blocks are scaled the same way and drawn from the
request's own seed (never shared). Requests longer than the engine's context are left out
(with their session's later requests). Each request generates one token
(``max_tokens=1``), so its wall time is its TTFT.

NOTE 1 (pressure relative to the machine): vLLM's block size and state dtypes depend on the
CPU (384 tokens and a float32 GDN state with AVX-512-BF16, 256 and bfloat16 with AVX2; see
``engine_facts``), so the same workload takes a different number of bytes on each machine.
The demo asks vLLM for the layout first and sizes the CPU and the disk tier each to
``--cache-fraction`` of what a state-per-chunk cache of this workload needs *at that layout*:
HiState and stock LMCache face the same relative pressure everywhere. TTFTs are wall times of
the tiny model on this CPU and vary by 30x between machines; compare the rows, not the
absolute numbers.

Between requests vLLM's own prefix cache is reset: the engine's KV pool stands for a GPU that
cannot hold sessions between turns (the paper's setting: 24 concurrent sessions), so every
reuse goes through LMCache and its tiers, which is what is compared.

The package: ``workload`` (the replay), ``servers`` (``histate-server`` processes),
``engine_proc`` (a ``vllm.LLM`` in a child process; also used by the live tests),
``runs`` (the replay against the server variants, interleaved), ``report`` (tables and
summary), ``main`` (the command line). The tiny model generator is
``lmcache_histate.backends.demo.tiny_model``.
"""

from .main import main
from .workload import SOURCE_BLOCK, DemoRequest, build_workload

__all__ = ["SOURCE_BLOCK", "DemoRequest", "build_workload", "main"]
