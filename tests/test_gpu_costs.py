"""``scripts/gpu_costs.py`` keeps working on a CPU (its tiny smoke run), and
``scripts/gpu_costs_fit.py`` turns its JSON into a cost model the simulator loads.

Pure: the scripts run as subprocesses in a temporary folder; no server, no engine. The
tiny run's numbers are a loaded CPU's and asserted only for shape and sign; the expected
sizes are derived by hand from the ``tiny-qwen3-next`` preset.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lmcache_histate.sim.config import ConfigError, load_cost_model, load_setup

ROOT = Path(__file__).resolve().parents[1]
MEASURED = "cost_model_qwen35_9b_h100_measured.yaml"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("gpu_costs") / "tiny.json"
    done = run("scripts/gpu_costs.py", "--tiny", "--json", str(out), "--budget-s", "900",
               "--disk-dir", str(out.parent))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "gpu_costs: wrote" in done.stdout
    return out, json.loads(out.read_text())


def test_the_tiny_run_passes_its_correctness_checks(tiny: tuple[Path, dict[str, Any]]) -> None:
    data = tiny[1]
    assert data["schema"] == "gpu_costs/1" and data["mode"] == "tiny"
    checks = {c["name"]: c for c in data["correctness"]["checks"]}
    assert set(checks) == {"stack_vs_fp32", "one_vs_two_steps", "kernel_vs_fp32",
                           "capture_vs_separate_steps"}
    assert all(c["passed"] and c["value"] <= c["tolerance"] for c in checks.values())
    assert data["correctness"]["passed"] is True
    assert checks["capture_vs_separate_steps"]["value"] == 0.0


def test_the_json_has_every_section_with_the_preset_sizes(
        tiny: tuple[Path, dict[str, Any]]) -> None:
    data = tiny[1]
    geo = data["geometry"]
    # tiny-qwen3-next: 3 GDN layers then 1 attention layer.
    assert geo["layer_kinds"] == ["gdn", "gdn", "gdn", "attention"]
    # KV per token: 1 attention layer x (K, V) x 2 KV heads x 64 dims x 2 bytes = 512.
    assert geo["kv_bytes_per_token"] == 512
    # Snapshot: 3 layers x (conv 3 x (2*4*64 + 8*64) x 2 B + SSM 8 x 64 x 64 x 4 B)
    #         = 3 x (6,144 + 131,072) = 411,648 bytes.
    assert geo["snapshot_bytes"] == 411_648
    assert geo["block_tokens"] == 8 and geo["step_tokens"] == 128
    copies = {r["what"]: r for r in data["copies"]}
    assert copies["snapshot"]["bytes"] == 411_648
    assert copies["kv_chunk"]["bytes"] == 8 * 512
    assert all(r["round_trip_equal"] and r["h2d_s"] > 0 and r["d2h_s"] > 0
               for r in copies.values())
    reads = {r["what"]: r for r in data["disk"]["reads"]}
    assert set(reads) == {"snapshot", "kv_chunk"} and all(r["cold_s"] > 0 for r in reads.values())
    assert data["disk"]["disk"]["path"] == str(tiny[0].parent) and "fstype" in data["disk"]["disk"]
    # 32 blocks in one step, then in steps of 16, 4 and 1 blocks.
    rows = data["step_price"]["rows"]
    assert [(r["blocks_per_step"], r["steps"]) for r in rows] == [(32, 1), (16, 2), (4, 8),
                                                                   (1, 32)]
    assert all("price_s_per_step_end" in r for r in rows[1:])
    # A 16-block step with a state every 8, 4 and 1 blocks: 1, 3 and 15 states inside it.
    capture = data["capture"]["rows"]
    assert sorted({r["method"] for r in capture}) == ["grid (torch-chunked)",
                                                      "segments (torch-chunked)"]
    assert [r["states"] for r in capture] == [1, 3, 15, 1, 3, 15]
    assert all(r["states_equal_separate_steps"] for r in capture)
    assert [(r["hit_tokens"], r["input_tokens"]) for r in data["prefill"]] == [
        (0, 64), (0, 128), (0, 256), (0, 512), (128, 256), (256, 512)]
    assert data["fit"]["prefill_s_per_token"] >= 0
    assert data["fit"]["attention_s_per_token_pair"] >= 0
    assert data["skipped"] == []


def test_the_fit_writes_a_cost_model_the_simulator_loads(
        tiny: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    path, data = tiny
    out = tmp_path / MEASURED
    done = run("scripts/gpu_costs_fit.py", str(path), "--out", str(out), "--allow-cpu-smoke")
    assert done.returncode == 0, done.stderr
    cost = load_cost_model(MEASURED, base=tmp_path)  # the measured file's name resolves
    assert cost.name == "qwen3.5-9b-h100-measured-cpu-smoke"
    copies, reads = data["copies"], data["disk"]["reads"]
    expect = {
        "pcie_bytes_per_s": sum(r["bytes"] for r in copies) / sum(r["h2d_s"] for r in copies),
        "ssd_bytes_per_s": sum(r["bytes"] for r in reads) / sum(r["cold_s"] for r in reads),
        "prefill_s_per_token": data["fit"]["prefill_s_per_token"],
        "attention_s_per_token_pair": data["fit"]["attention_s_per_token_pair"],
        "step_overhead_s": max(0.0, data["step_price"]["rows"][-1]["price_s_per_step_end"]),
    }
    for key, value in expect.items():
        assert getattr(cost, key) == pytest.approx(value, rel=1e-5, abs=1e-12), key
    # Not measured: the estimates file's decode (10 ms) and request overhead (20 ms).
    assert cost.decode_s_per_token == 0.010 and cost.request_overhead_s == 0.020
    assert "NOT measured" in out.read_text()
    config = tmp_path / "sim.yaml"
    config.write_text(f"name: measured\ncost_model: {MEASURED}\n")
    assert load_setup(config).cost.name == cost.name


def test_the_fit_refuses_what_measures_no_gpu(tiny: tuple[Path, dict[str, Any]],
                                              tmp_path: Path) -> None:
    path, data = tiny
    out = tmp_path / "m.yaml"
    done = run("scripts/gpu_costs_fit.py", str(path), "--out", str(out))
    assert done.returncode == 2 and "a CPU smoke run measures no GPU" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    broken = tmp_path / "broken.json"
    data = json.loads(json.dumps(data))
    data["correctness"]["passed"] = False
    data["correctness"]["checks"][0]["passed"] = False
    broken.write_text(json.dumps(data))
    done = run("scripts/gpu_costs_fit.py", str(broken), "--out", str(out), "--allow-cpu-smoke")
    assert done.returncode == 2 and "correctness check failed (stack_vs_fp32)" in done.stderr
    (tmp_path / "bad.json").write_text("{not json")
    done = run("scripts/gpu_costs_fit.py", str(tmp_path / "bad.json"), "--out", str(out))
    assert done.returncode == 2 and done.stderr.startswith("gpu_costs_fit: ")
    done = run("scripts/gpu_costs_fit.py", str(path), "--allow-cpu-smoke")
    assert done.returncode == 2 and "needs --out" in done.stderr
    assert not out.exists()  # nothing written by a refused run


@pytest.mark.parametrize("bad", ["disk", "kernel"])
def test_a_bad_setting_is_one_line(tmp_path: Path, bad: str, capsys: pytest.CaptureFixture[str],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process (``main(argv)``): the same exit status and line, without a second torch
    start-up per case."""
    spec = importlib.util.spec_from_file_location("gpu_costs", ROOT / "scripts" / "gpu_costs.py")
    assert spec is not None and spec.loader is not None
    gpu_costs = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_costs", gpu_costs)  # its dataclasses look it up
    spec.loader.exec_module(gpu_costs)
    extra = (["--disk-dir", str(tmp_path / "nowhere")] if bad == "disk" else
             ["--gdn-kernel", "fla", "--device", "cpu"])  # fla's kernels need CUDA
    assert gpu_costs.main(["--tiny", "--json", str(tmp_path / "x.json"), *extra]) == 2
    assert capsys.readouterr().err.strip() == (
        f"gpu_costs: --disk-dir {tmp_path / 'nowhere'} is not a folder" if bad == "disk"
        else "gpu_costs: --gdn-kernel fla needs a CUDA device")
    assert not (tmp_path / "x.json").exists()


def test_an_unknown_cost_model_lists_the_shipped_ones() -> None:
    with pytest.raises(ConfigError) as err:
        load_cost_model("nowhere")
    assert "shipped: " in str(err.value) and "cost_model_qwen35_9b_h100.yaml" in str(err.value)
    assert "scripts/gpu_costs_fit.py" in str(err.value)
