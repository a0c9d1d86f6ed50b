"""A session whose next turn lands on another node resumes there through the shared tier.

Real parts only: a 3-master Redis Cluster on loopback, two ``histate-server`` processes
(nodes ``a`` and ``b``) with separate disk folders and the same ``shared_tier`` section,
each with its own vLLM CPU engine serving the tiny hybrid model, and the reference engine
without a connector (``reference_run``). Prompts are ``test_vllm_cpu_roundtrip``'s: turn 1
on node A is the prefix that prompts B and C share (8.6 chunks); node A's server keeps an
interval snapshot below chunk 8 and the final one at ``8C`` on its own tiers and sends the
shared tier the 8 KV chunks and the final snapshot only (``shared_tier.plan``: what another
node resumes from). Turn 2, prompt B (that prefix, then its own tail), runs on node B,
whose own tiers hold nothing: B hits exactly 8 chunks, all 8 KV chunks and the snapshot
loaded from the shared tier (none from its disk), and its greedy tokens and top-5
logprobs equal the reference's exactly. Negative control: with node B's test hook zeroing
restored recurrent state, prompt C (same prefix, another tail) hits the same boundary and
its logprobs differ from recompute.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from support.redis_cluster import RedisClusterNodes
from test_shared_tier_servers import tier_section
from test_vllm_cpu_roundtrip import (
    LAUNCHER,
    MAX_TOKENS,
    TOP_LOGPROBS,
    ZERO_HOOK_MODULE,
    connector_config,
    histate_config,
    make_prompts,
    needs_live,
    prompt_lengths,
    server_module_arg,
    settle,
)


def loads(status: dict[str, Any], tier: str) -> int:
    stats = (status.get(tier) or {}).get("stats") or {}
    return sum(v for n, v in stats.items() if n.startswith("loads_group_"))


@needs_live
def test_turn_two_on_node_b_resumes_from_node_a_through_the_shared_tier(
    tmp_path: Path, tiny_model: Path, tiny_layout: Any, reference_run: dict[str, Any],
    redis_cluster: RedisClusterNodes,
) -> None:
    from lmcache_histate.backends.demo.engine_proc import EngineProcess, engine_kwargs
    from support.lmcache_mp import lmcache_server, support_pythonpath
    from support.load_counts import reconciled_loads

    chunk = tiny_layout.block_size
    config = json.loads((tiny_model / "config.json").read_text())
    prompts = make_prompts(vocab=int(config["vocab_size"]), chunk=chunk)
    zero_flag = tmp_path / "zero-restored-recurrent"
    commands = {}
    for name in ("a", "b"):
        cfg = histate_config(tmp_path / f"histate-{name}.yaml", tiny_model,
                             tmp_path / f"disk-{name}",
                             shared_tier=tier_section(redis_cluster, name, budget_gib=0.2))
        commands[name] = [sys.executable, "-m", LAUNCHER, "--config", str(cfg)]
    ask = {"histate_saves": True, "cached_token_stats": True}

    def engine_on(server: Any, name: str) -> EngineProcess:
        kwargs = engine_kwargs(tiny_model, chunk_tokens=chunk,
                               kv_transfer_config=connector_config(server.endpoints.zmq_port))
        return EngineProcess(kwargs, workdir=tmp_path, name=name, block_size=chunk)

    with (
        lmcache_server(workdir=tmp_path / "server-a", chunk_size=None, l1_size_gb=0.1,
                       command=commands["a"], startup_timeout=180,
                       env=support_pythonpath()) as server_a,
        lmcache_server(server_module_arg(ZERO_HOOK_MODULE, {"flag": str(zero_flag)}),
                       workdir=tmp_path / "server-b", chunk_size=None, l1_size_gb=0.1,
                       command=commands["b"], startup_timeout=180,
                       env=support_pythonpath()) as server_b,
    ):
        with engine_on(server_a, "engine-a") as engine_a:
            turn1 = prompts["B"][: prompt_lengths(chunk)["shared"]]
            a = engine_a.generate(turn1, max_tokens=MAX_TOKENS, kv_transfer_params=ask,
                                  reset=True)
            final_a = settle(server_a)
        with engine_on(server_b, "engine-b") as engine_b:
            b = engine_b.generate(prompts["B"], max_tokens=MAX_TOKENS, logprobs=TOP_LOGPROBS,
                                  kv_transfer_params=ask, reset=True)
            after_b = settle(server_b)
            zero_flag.touch()  # arm the negative control
            c = engine_b.generate(prompts["C"], max_tokens=MAX_TOKENS, logprobs=TOP_LOGPROBS,
                                  kv_transfer_params=ask, reset=True)
            settle(server_b)
            loaded_b = reconciled_loads(server_b, engine_b)  # what B's vLLM took
        metrics = server_b.http("GET", "/metrics")

    kept = a["kv_transfer_params"]["histate_saves"]["kept"]
    assert kept[-1] == 8 * chunk and 0 < kept[0] < 8 * chunk, kept  # interval + final
    # Node A sent the shared tier its 8 KV chunks and the final snapshot, not the interval.
    shared_a = final_a["shared_tier"]
    assert shared_a["mode"] == "connected"
    assert shared_a["stats"]["objects_stored"] == 8 + 1, shared_a["stats"]
    # Turn 2 on node B: 8 chunks, all 8 KV chunks + the snapshot at 8C from the shared tier.
    assert b["num_cached_tokens"] == 8 * chunk
    assert b["kv_transfer_params"]["cached_token_stats"]["num_lmcache_cached_tokens"] == 8 * chunk
    assert loads(after_b, "shared_tier") == 8 + 1
    assert loads(after_b, "disk") == 0
    reference = reference_run
    assert b["token_ids"] == reference["B"]["token_ids"]
    assert b["logprobs"] == reference["B"]["logprobs"]  # exact float equality, all top-5
    # Negative control: the same hit with the restored recurrent state zeroed differs.
    assert c["num_cached_tokens"] == 8 * chunk
    assert c["logprobs"] != reference["C"]["logprobs"], "zeroed state left outputs unchanged"
    # B's server loaded what B's vLLM took: 8 chunks for B and 8 for C (caches reset).
    assert loaded_b == 2 * 8 * chunk
    text = metrics if isinstance(metrics, str) else json.dumps(metrics)
    assert 'histate_l2_objects_loaded{tier="shared"}' in text
