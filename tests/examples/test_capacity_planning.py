"""``examples/capacity_planning.py``: a simulator capacity sweep on a user's own trace.

* ``plan`` (the example's reading of a sweep) picks the smallest capacity whose HiState p99
  TTFT is within the slack of the unlimited cache's, checked on hand-made points;
* the script runs end to end on a trace folder of the user's (two files of the bundled Weka
  sample copied elsewhere) and a user set-up file, and its table rows are the configured
  capacities scaled by the sweep's factors;
* by default (the bundled sample on ``configs/sim-sample.yaml``) it teaches what its
  docstring says: HiState meets the target only from 4x the configured CPU + disk, not at
  the smallest capacity, and vLLM's offload at none.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from types import ModuleType

from support.examples import EXAMPLES, run_example

from lmcache_histate.sim.runner import SweepPoint
from lmcache_histate.sim.traces import sample_trace_dir

EXAMPLE = EXAMPLES / "capacity_planning.py"
GIB = 1 << 30


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("capacity_planning", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plan_picks_the_smallest_capacity_within_the_slack() -> None:
    def point(policy: str, factor: float, p99: float) -> SweepPoint:
        return SweepPoint(policy, factor, int(factor * 8 * GIB), int(factor * 16 * GIB),
                          0.5, p99 / 2, p99)

    points = [point("histate", 0.5, 3.0), point("vllm-cpu-disk-offload", 0.5, 4.0),
              point("histate", 1.0, 2.1), point("vllm-cpu-disk-offload", 1.0, 3.0),
              point("histate", 2.0, 2.0), point("vllm-cpu-disk-offload", 2.0, 2.5)]
    # Reference p99 2.0 s, slack 10 %: target 2.2 s -> factor 1.0 (2.1 s) is the first.
    result = _example().plan(points, reference_p99=2.0, slack=0.1)
    assert result["target_p99_s"] == 2.0 * 1.1
    assert [r["factor"] for r in result["rows"]] == [0.5, 1.0, 2.0]
    assert result["recommended"]["factor"] == 1.0
    assert (result["recommended"]["cpu_gib"], result["recommended"]["disk_gib"]) == (8.0, 16.0)
    # Slack 0: only 2.0 s meets 2.0 s.
    assert _example().plan(points, 2.0, 0.0)["recommended"]["factor"] == 2.0
    assert _example().plan(points, 1.0, 0.0)["recommended"] is None


def test_capacity_planning_runs_on_a_users_trace(tmp_path: Path) -> None:
    traces = tmp_path / "my-traces"
    traces.mkdir()
    for name in ("trace_0028.json.gz", "trace_0602.json.gz"):
        shutil.copy(sample_trace_dir() / name, traces / name)
    setup = tmp_path / "my-setup.yaml"
    setup.write_text("model: qwen3.5-9b\nchunk_tokens: 528\nmax_sessions: 4\n"
                     "capacity: {gpu: 2GiB, cpu: 8GiB, disk: 16GiB}\n")
    out = tmp_path / "plan.json"
    output = run_example(
        "capacity_planning.py",
        ["--trace", str(traces), "--config", str(setup), "--out", str(tmp_path / "report"),
         "--json", str(out)], timeout=300)
    assert "trace my-traces: 2 sessions" in output
    result = json.loads(out.read_text())
    factors = [1 / 8, 1 / 4, 1 / 2, 1.0, 2.0, 4.0, 8.0, 16.0]
    assert [r["factor"] for r in result["rows"]] == factors
    assert [r["cpu_gib"] for r in result["rows"]] == [8 * f for f in factors]
    assert [r["disk_gib"] for r in result["rows"]] == [16 * f for f in factors]
    meets = [r for r in result["rows"] if r["histate"]["p99_s"] <= result["target_p99_s"]]
    assert result["recommended"] == (meets[0] if meets else None)
    assert (tmp_path / "report" / "report.md").is_file()


def test_default_run_needs_capacity_and_separates_the_rows(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    output = run_example("capacity_planning.py",
                         ["--out", str(tmp_path / "report"), "--json", str(out)], timeout=300)
    result = json.loads(out.read_text())
    first = result["first_meeting"]
    # configs/sim-sample.yaml: 2 GiB CPU + 4 GiB disk; 4x = 8 + 16 GiB.
    assert (first["histate"]["factor"], first["histate"]["cpu_gib"],
            first["histate"]["disk_gib"]) == (4.0, 8.0, 16.0)
    assert first["vllm-cpu-disk-offload"] is None
    assert "vLLM CPU+disk offload: no capacity in the sweep meets the target" in output
