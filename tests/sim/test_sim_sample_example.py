"""The small simulator example of the README: ``configs/sim-sample.yaml`` on the bundled
sample parts the rows, ``--list-policies`` says what each row is, and the plot's legend
sits outside the curves."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from lmcache_histate.cli import main
from lmcache_histate.sim.experiment import policy_names

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "sim-sample.yaml"
ROWS = "histate,lru,vllm-cpu-disk-offload,sglang-hicache-l3,unlimited"


def test_list_policies_gives_each_row_its_memory_and_meaning(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["simulate", "--list-policies"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split()[0] for ln in lines] == list(policy_names())
    by_name = {ln.split()[0]: ln for ln in lines}
    # The paper's set-up: 45 + 96 + 150 GiB for the three-tier rows, 45 GiB GPU-only.
    assert "291 GiB" in by_name["histate"] and "45 GiB" in by_name["marconi"]
    assert "∞" in by_name["unlimited"]
    assert "retention-interval 4096" in by_name["vllm-retention"]
    assert all(len(ln.split(None, 3)) == 4 for ln in lines)  # name, memory, unit, meaning


def test_the_sample_config_parts_the_rows(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert main(["simulate", "--config", str(CONFIG), "--policies", ROWS, "--out",
                 str(out)]) == 0
    rows = {p["name"]: p for p in json.loads((out / "report.json").read_text())["policies"]}
    assert list(rows) == ROWS.split(",")
    # Every two rows' mean TTFTs at least 5 % apart: the plot shows five curves, not one.
    for a, b in itertools.combinations(rows.values(), 2):
        lo, hi = sorted((a["ttft"]["mean"], b["ttft"]["mean"]))
        assert hi >= 1.05 * lo, (a["name"], b["name"])
    # The tiers fill (that is what parts the rows): HiState ends ≥ 80 % full of 8 GiB.
    assert rows["histate"]["capacity_bytes"] == 8 * (1 << 30)
    assert rows["histate"]["used_bytes"] >= 0.8 * 8 * (1 << 30)
    assert (out / "ttft_cdf.png").stat().st_size > 0
