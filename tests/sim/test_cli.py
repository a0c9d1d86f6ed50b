"""``histate simulate`` end to end on the embedded sample, and its error handling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmcache_histate.cli import main
from lmcache_histate.sim.experiment import policy_names


def test_simulate_sample_writes_table_and_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert main(["simulate", "--no-plots", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    names = policy_names()
    assert "histate" in names
    md = (out / "report.md").read_text()
    doc = json.loads((out / "report.json").read_text())
    assert [p["name"] for p in doc["policies"]] == names
    for name in names:
        assert f"| {name} |" in md and f"| {name} |" in printed
    assert not list(out.glob("*.png"))


def test_synthetic_rewrite_reports_rewriting_requests(tmp_path: Path) -> None:
    out = tmp_path / "rw"
    argv = ["simulate", "--synthetic", "rewrite", "--rewrite-share", "0.1", "--policies",
            "histate", "--no-plots", "--out", str(out)]
    assert main(argv) == 0
    doc = json.loads((out / "report.json").read_text())
    (pol,) = doc["policies"]
    assert pol["rewriting"]["n"] == 36  # 10 % of 24 sessions x 15 eligible turns
    assert doc["meta"]["rewrite_scope"] == "last"  # the default: cuts in the latest turn
    assert main([*argv, "--rewrite-scope", "any", "--out", str(tmp_path / "any")]) == 0
    meta = json.loads((tmp_path / "any" / "report.json").read_text())["meta"]
    assert (meta["trace"], meta["rewrite_scope"]) == ("paper-rewrite-0.1-any-s0", "any")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--trace", "/no/such/trace"], "trace not found: /no/such/trace"),
        (["--config", "/no/such.yaml"], "config not found"),
        (["--policies", "histate,nope"], "unknown policy nope"),
    ],
)
def test_user_errors_exit_2_without_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert main(["simulate", "--no-plots", "--out", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_corrupt_trace_file_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "trace_0001.json.gz"
    bad.write_bytes(b"\x1f\x8b not really gzip")
    assert main(["simulate", "--trace", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert str(bad) in capsys.readouterr().err


def test_sweep_and_plots(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "sw"
    argv = ["simulate", "--sweep", "--policies", "histate", "--out", str(out)]
    assert main(argv) == 0
    doc = json.loads((out / "report.json").read_text())
    swept = {p["policy"] for p in doc["sweep"]}
    assert "histate" in swept and len(doc["sweep"]) >= 2 * len(swept) + 1
    assert (out / "ttft_cdf.png").stat().st_size > 0
    assert (out / "hit_rate_vs_capacity.png").stat().st_size > 0


def test_same_memory_view_reruns_the_smaller_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The paper's memory: HiState 45 + 96 + 150 = 291 GiB, vLLM GPU-only 45 GiB, vLLM CPU
    offload 45 + 96 = 141 GiB; the same-memory table re-runs the two smaller rows at 291
    GiB (vLLM CPU+disk already has it, so it is not repeated)."""
    out = tmp_path / "same"
    argv = ["simulate", "--policies", "histate,vllm-align-gpu,vllm-cpu-offload,"
            "vllm-cpu-disk-offload", "--same-memory", "--no-plots", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "| vllm-align-gpu | 45 |" in printed and "| vllm-cpu-offload | 141 |" in printed
    assert "Same total memory: every row with 291 GiB" in printed
    doc = json.loads((out / "report.json").read_text())
    same = {p["name"]: p["capacity_bytes"] / 2**30 for p in doc["same_memory"]}
    assert same == {"histate": 291, "vllm-align-gpu": 291, "vllm-cpu-offload": 291}
    assert "requests/h" in doc["meta"]["load"]
