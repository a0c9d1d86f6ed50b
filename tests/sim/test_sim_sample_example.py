"""The small simulator example of the README: ``configs/sim-sample.yaml`` on the bundled
sample parts the rows (the paper's set-up, which the sample does not fill, says so and
points to it), and ``--list-policies`` says what each row is."""

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


def test_the_paper_config_on_the_sample_says_nothing_filled(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "out")
    assert main(["simulate", "--policies", "histate,unlimited", "--no-plots", "--out", out]) == 0
    # 45 + 96 + 150 GiB against a sample whose every state takes 72 GiB: HiState ends
    # 12 % full, and the command says what to run instead.
    assert "note: no row filled more than 12 % of its memory" in capsys.readouterr().out


def test_the_sample_config_parts_the_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert main(["simulate", "--config", str(CONFIG), "--policies", ROWS, "--out",
                 str(out)]) == 0
    assert "note: no row filled" not in capsys.readouterr().out
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
