"""The simulator's results, pinned: any change in any number fails until it is re-recorded.

The replay is deterministic (``server``: one event heap, ties in insertion order; the
baselines draw from the configured seed), so a run of the same trace under the same
set-up gives the same table to the last bit. Three runs are pinned, each as its Markdown
table (what a reader compares) and every summary number to 12 significant digits (what
the table rounds away):

* ``weka-sample``: the bundled Weka sample under the paper's set-up, every policy — the
  table ``histate simulate`` prints by default;
* ``weka-sample-tight``: the same sample with 2 GiB GPU, 2 GiB CPU and 4 GiB disk, where
  the sample does not fit and the eviction and placement rules decide the hits (at the
  paper's capacities it never fills the cache: every tiered row there is within 0.4
  points of the unlimited one). Rows: the HiState variants and every tiered row
  (Marconi's GPU-only row aside);
* ``synthetic-rewrite``: the paper's rewrite test (10 % rewriting requests), every policy.

A change of results must be deliberate: re-record in the same commit with

    HISTATE_UPDATE_SNAPSHOTS=1 .venv/bin/python -m pytest -q tests/sim/test_pinned_results.py

and say in the commit message why the numbers moved.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from lmcache_histate.sim.experiment import SimulateOptions, run_simulate

PINNED = Path(__file__).resolve().parent.parent / "data" / "pinned"
UPDATE = os.environ.get("HISTATE_UPDATE_SNAPSHOTS") == "1"
DIGITS = 12

TIGHT_CONFIG = """\
name: paper-tight
model: qwen3.5-9b
chunk_tokens: 528
capacity: {gpu: 2GiB, cpu: 2GiB, disk: 4GiB}
max_sessions: 24
max_think_s: 600
session_gap_s: 60
gpu_scheduling: shared
seed: 0
histate: {tau: 600.0, max_interval_chunks: 64, ema_alpha: 0.05}
cost_model: cost_model_qwen35_9b_h100.yaml
"""
TIGHT_ROWS = ("histate,histate-fixed-tau,histate-align,histate-every32,histate-measured,"
              "histate-neutral-start,"
              "unlimited,marconi,"
              "vllm-align-gpu,vllm-cpu-offload,vllm-cpu-disk-offload,vllm-retention,"
              "sglang-hicache,"
              "sglang-hicache-l3,lru,lru-refresh-all,"
              "file-lru")


def _rounded(x: Any) -> Any:
    """Floats to ``DIGITS`` significant digits (``inf``/``nan`` as strings), recursively."""
    if isinstance(x, float):
        return str(x) if not math.isfinite(x) else float(f"{x:.{DIGITS}g}")
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_rounded(v) for v in x]
    return x


def _results(opts: SimulateOptions) -> dict[str, Any]:
    exp = run_simulate(opts)
    rows = []
    for s in exp.summaries:
        row = asdict(s)
        del row["wall_s"]  # host time, not a result
        rows.append(_rounded(row))
    return {"table": exp.table.splitlines(), "sensitive": exp.sensitive, "rows": rows}


CASES = {
    "weka-sample": {},
    "weka-sample-tight": {"config": "tight", "policies": TIGHT_ROWS},
    "synthetic-rewrite": {"synthetic": "rewrite", "rewrite_share": 0.1},
}


@pytest.mark.parametrize("name", list(CASES))
def test_results_match_the_pinned_snapshot(name: str, tmp_path: Path) -> None:
    kw: dict[str, Any] = dict(CASES[name])
    if kw.get("config") == "tight":
        cfg = tmp_path / "tight.yaml"
        cfg.write_text(TIGHT_CONFIG)
        kw["config"] = str(cfg)
    got = _results(SimulateOptions(out=str(tmp_path / "out"), plots=False, **kw))
    path = PINNED / f"{name}.json"
    if UPDATE:
        PINNED.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(got, indent=1, ensure_ascii=False) + "\n")
    want = json.loads(path.read_text())
    # The table first: its diff is the readable one.
    assert got["table"] == want["table"], f"{name}: the results table changed (see module doc)"
    assert got == want, f"{name}: a result changed beyond the table's rounding"
