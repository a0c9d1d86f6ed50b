"""Simulation config and cost-model loading: defaults, validation naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmcache_histate.sim.config import (
    GIB,
    ConfigError,
    SimSetup,
    load_cost_model,
    load_setup,
    parse_bytes,
)

REPO = Path(__file__).resolve().parents[2]


def test_paper_config_file_is_the_built_in_default() -> None:
    s = load_setup(REPO / "configs" / "sim-paper.yaml")
    assert s == SimSetup.paper()
    assert (s.chunk_tokens, s.max_sessions) == (528, 24)
    assert (s.gpu_bytes, s.cpu_bytes, s.disk_bytes) == (45 * GIB, 96 * GIB, 150 * GIB)
    assert s.kv_chunk_bytes == 528 * 32768 and s.snapshot_bytes == 51_511_296


def test_cost_model_numbers() -> None:
    c = load_cost_model()
    assert c.pcie_bytes_per_s == 50e9 and c.ssd_bytes_per_s == 5e9
    # docs/design.md §1: KV of 100K tokens over PCIe 5 ≈ 65 ms; a snapshot from SSD ≈ 10 ms.
    assert c.load_time({"cpu": 100_000 * 32768}) == pytest.approx(0.0655, abs=1e-3)
    assert c.load_time({"disk": 51_511_296, "gpu": 10**12}) == pytest.approx(0.0103, abs=1e-3)
    assert 8.0 < c.prefill_time(0, 100_000) < 12.0
    with pytest.raises(ValueError, match="unknown tier"):
        c.load_time({"nvme": 1})


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("capacity: {cpu: lots}", r"capacity\.cpu"),
        ("capacity: {hbm: 1GiB}", "unknown tier 'hbm'"),
        ("histate: {tau: -1}", "tau"),
        ("histate: {bogus: 1}", "bogus"),
        ("chunk_tokens: 0", "chunk_tokens"),
        ("model: no-such-model", "model"),
        ("cost_model: nowhere.yaml", "cost_model"),
        ("max_sessions: many", "max_sessions"),
        ("colour: blue", "colour"),
        ("[1, 2]", "mapping"),
    ],
)
def test_bad_config_names_the_key(tmp_path: Path, text: str, match: str) -> None:
    p = tmp_path / "c.yaml"
    p.write_text(text + "\n")
    with pytest.raises(ConfigError, match=match):
        load_setup(p)


def test_max_interval_knob_has_the_server_name_and_the_old_one_still_reads(
    tmp_path: Path,
) -> None:
    """``histate.max_interval_chunks`` is the server's name for the knob; the simulator's
    old ``max_interval_multiple`` still loads, with a warning naming the new key."""
    new = tmp_path / "new.yaml"
    new.write_text("histate: {max_interval_chunks: 8}\n")
    assert load_setup(new).max_interval_chunks == 8
    old = tmp_path / "old.yaml"
    old.write_text("histate: {max_interval_multiple: 8}\n")
    with pytest.warns(FutureWarning, match=r"histate\.max_interval_multiple is deprecated; "
                      r"use histate\.max_interval_chunks"):
        assert load_setup(old).max_interval_chunks == 8
    both = tmp_path / "both.yaml"
    both.write_text("histate: {max_interval_multiple: 8, max_interval_chunks: 8}\n")
    with pytest.raises(ConfigError, match="same knob"):
        load_setup(both)


def test_bad_cost_model_names_the_key(tmp_path: Path) -> None:
    src = load_cost_model.__globals__["_data_path"]("cost_model_qwen35_9b_h100.yaml")
    text = Path(src).read_text().replace("ssd_bytes_per_s: 5.0e+9", "ssd_bytes_per_s: 0")
    (tmp_path / "cm.yaml").write_text(text)
    with pytest.raises(ConfigError, match="ssd_bytes_per_s"):
        load_cost_model("cm.yaml", base=tmp_path)
    (tmp_path / "cm.yaml").write_text(text.replace("ssd_bytes_per_s: 0\n", ""))
    with pytest.raises(ConfigError, match="missing key 'ssd_bytes_per_s'"):
        load_cost_model("cm.yaml", base=tmp_path)


def test_parse_bytes() -> None:
    assert parse_bytes("45GiB", "k") == 45 * GIB
    assert parse_bytes("1.5 GB", "k") == 1_500_000_000
    assert parse_bytes(1024, "k") == 1024
    with pytest.raises(ConfigError, match="k:"):
        parse_bytes("-3 GiB", "k")


def test_capture_time_by_hand() -> None:
    """100K recomputed tokens in 528-token steps instead of 8,192: ceil(100000/528) = 190
    vs ceil(100000/8192) = 13, + 1 forced split = 178 steps × 2 ms = 0.356 s; two
    51,511,296-byte states over 50 GB/s = 2.06 ms."""
    from lmcache_histate.sim.capture import Capture

    c = load_cost_model()
    assert (c.step_overhead_s, c.engine_step_tokens) == (2e-3, 8192)
    compute, copy = c.capture_time(Capture(528, 1, 2), 100_000, 51_511_296)
    assert compute == pytest.approx(0.356)
    assert copy == pytest.approx(2 * 51_511_296 / 50e9)
    assert c.capture_time(Capture(528), 500, 1) == (0.0, 0.0)  # one step either way


def test_step_grid_from_the_cost_model() -> None:
    """The shipped model: 8,192 // 528 = 15 chunks = 7,920 tokens; 2 ms / 80 µs = 25
    tokens. A budget below one chunk still ends a step per chunk; free prefill prices a
    step end at 0."""
    from dataclasses import replace

    c = load_cost_model()
    step, price = c.step_grid(528)
    assert step == 7920 and price == pytest.approx(25.0)
    assert c.step_grid(8192) == (8192, pytest.approx(25.0))
    assert replace(c, engine_step_tokens=300).step_grid(528)[0] == 528
    assert replace(c, prefill_s_per_token=0.0).step_grid(528) == (7920, 0.0)


def test_capture_constants_can_be_overridden(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("capture:\n  step_overhead_s: 0.004\n")
    assert load_setup(f).cost.step_overhead_s == 0.004
    f.write_text("capture:\n  step_overhead: 1\n")
    with pytest.raises(ConfigError, match="capture: unknown key 'step_overhead'"):
        load_setup(f)
    f.write_text("capture:\n  engine_step_tokens: 0\n")
    with pytest.raises(ConfigError, match="engine_step_tokens"):
        load_setup(f)
