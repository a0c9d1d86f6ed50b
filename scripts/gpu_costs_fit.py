#!/usr/bin/env python3
"""Turn ``scripts/gpu_costs.py``'s JSON into a cost-model YAML the simulator loads.

    .venv/bin/python scripts/gpu_costs_fit.py gpu_costs.json
    # -> lmcache_histate/data/cost_model_qwen35_9b_h100_measured.yaml

and a simulation config selects it with ``cost_model: cost_model_qwen35_9b_h100_measured.yaml``
(``sim/config.py: load_cost_model`` resolves the name in ``lmcache_histate/data``). The
estimates file ``cost_model_qwen35_9b_h100.yaml`` stays as it is, the default.

Each measured key, from the JSON:

* ``pcie_bytes_per_s``: the host → device copies of one snapshot and one KV chunk from
  pinned memory, total bytes over total time (``copies``, ``h2d_s``).
* ``ssd_bytes_per_s``: the cold file reads of the same two objects, total bytes over total
  time (``disk``, ``cold_s``); the disk is named in the YAML's header.
* ``prefill_s_per_token`` and ``attention_s_per_token_pair``: the fit of
  ``t = a·(n − h) + c·(n² − h²)/2`` over the prefill rows (``fit``).
* ``step_overhead_s``: the price of a step end with one-block steps (``step_price``). NOTE 1:
  the simulator charges one price per extra step end, for the rows that run one-block steps
  and for HiState's planned step ends alike; the one-block price is the largest of the
  three measured (it carries the lower matmul efficiency of 528-token steps), so the
  planned ends are charged at least what they cost, never less. All three prices are
  written in the header.

``decode_s_per_token`` and ``request_overhead_s`` are not measured (no decode, no engine
scheduler on the device): they are copied from the estimates file and marked so.

A JSON from a CPU smoke run (``mode: tiny``) or with a failed correctness check is refused
(one line, exit 2): ``--allow-cpu-smoke`` takes a tiny run's JSON, for testing this script
only, and then ``--out`` must name a file outside the package.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from lmcache_histate.sim.config import ConfigError, load_cost_model  # noqa: E402

SCHEMA = "gpu_costs/1"
DEFAULT_OUT = ROOT / "lmcache_histate" / "data" / "cost_model_qwen35_9b_h100_measured.yaml"
ESTIMATES = "cost_model_qwen35_9b_h100.yaml"


class FitError(ValueError):
    """The JSON cannot give a cost model; the message says which part."""


def _need(data: dict[str, Any], path: str) -> Any:
    node: Any = data
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            raise FitError(f"missing {path!r} (is this scripts/gpu_costs.py's JSON?)")
        node = node[key]
    return node


def _rows(data: dict[str, Any], path: str, key: str, names: tuple[str, ...]
          ) -> dict[str, dict[str, Any]]:
    rows = {r.get(key): r for r in _need(data, path) if isinstance(r, dict)}
    for name in names:
        if name not in rows:
            raise FitError(f"{path} has no {key} {name!r} row")
    return rows


def cost_model(data: dict[str, Any], *, allow_cpu_smoke: bool = False) -> tuple[dict[str, Any],
                                                                                 list[str]]:
    """``(values, header lines)`` of the measured cost model, from the JSON ``data``."""
    if data.get("schema") != SCHEMA:
        raise FitError(f"schema is {data.get('schema')!r}, expected {SCHEMA!r}")
    mode = _need(data, "mode")
    if mode != "full" and not allow_cpu_smoke:
        raise FitError(f"mode is {mode!r}: a CPU smoke run measures no GPU "
                       "(--allow-cpu-smoke only to test this script)")
    if _need(data, "correctness.passed") is not True:
        failed = [c.get("name") for c in _need(data, "correctness.checks") if not c.get("passed")]
        raise FitError(f"correctness check failed ({', '.join(map(str, failed))}): no cost model "
                       "from a model that computes the wrong thing")
    fit = _need(data, "fit")
    if not isinstance(fit, dict):
        raise FitError("fit is empty: fewer than two prefill rows were measured")
    copies = _rows(data, "copies", "what", ("snapshot", "kv_chunk"))
    reads = _rows(data, "disk.reads", "what", ("snapshot", "kv_chunk"))
    prices = {r["blocks_per_step"]: r.get("price_s_per_step_end")
              for r in _need(data, "step_price.rows")}
    if prices.get(1) is None:
        raise FitError("step_price has no one-block row (skipped for lack of time?)")
    estimates = load_cost_model(ESTIMATES)
    pcie = sum(r["bytes"] for r in copies.values()) / sum(r["h2d_s"] for r in copies.values())
    ssd = sum(r["bytes"] for r in reads.values()) / sum(r["cold_s"] for r in reads.values())
    values = {
        "name": f"{estimates.name}-measured" + ("-cpu-smoke" if mode != "full" else ""),
        "pcie_bytes_per_s": pcie,
        "ssd_bytes_per_s": ssd,
        "prefill_s_per_token": float(fit["prefill_s_per_token"]),
        "attention_s_per_token_pair": float(fit["attention_s_per_token_pair"]),
        "decode_s_per_token": estimates.decode_s_per_token,
        "request_overhead_s": estimates.request_overhead_s,
        "step_overhead_s": max(0.0, float(prices[1])),
        "engine_step_tokens": estimates.engine_step_tokens,
    }
    m, disk = _need(data, "machine"), _need(data, "disk.disk")
    header = [
        f"Cost model MEASURED by scripts/gpu_costs.py ({mode} run) and written by",
        "scripts/gpu_costs_fit.py; the estimates stay in " + ESTIMATES + ".",
        f"device: {m.get('device')}; torch {m.get('torch')}, CUDA {m.get('cuda')}, "
        f"triton {m.get('triton')}; GDN kernel: {m.get('gdn_kernel')}; {m.get('date_utc')}",
        f"command: {data.get('command')}",
        f"disk: {disk.get('block_device')} model={disk.get('model')} fs={disk.get('fstype')} "
        f"rotational={disk.get('rotational')} driver={disk.get('driver')}",
        "pcie_bytes_per_s: pinned host -> device copies of one snapshot and one KV chunk, "
        "total bytes / total time",
        "ssd_bytes_per_s: cold file reads (page cache dropped) of the same two objects",
        f"prefill_s_per_token, attention_s_per_token_pair: fit over {fit.get('rows')} prefill "
        f"rows, max relative residual {fit.get('max_rel_residual', float('nan')):.1%}",
        "step_overhead_s: price of a step end with one-block steps (gpu_costs_fit.py NOTE 1); "
        "all: " + ", ".join(f"{b} blocks {p * 1e3:.3f} ms" for b, p in sorted(prices.items())
                            if p is not None),
        "decode_s_per_token, request_overhead_s, engine_step_tokens: NOT measured, copied "
        "from the estimates",
    ]
    return values, header


def write_yaml(values: dict[str, Any], header: list[str], out: Path) -> None:
    """The YAML, then loaded back with the simulator's own loader (a value it refuses is
    an error here, and the file is not left behind)."""
    body = ["# " + line for line in header] + [""]
    for key, value in values.items():
        body.append(f"{key}: {value!r}" if isinstance(value, str) else f"{key}: {value:.6g}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("\n".join(body) + "\n")
    try:
        load_cost_model(tmp.resolve())
    except ConfigError:
        tmp.unlink()
        raise
    tmp.replace(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", help="the JSON scripts/gpu_costs.py wrote")
    ap.add_argument("--out", default=None,
                    help=f"the YAML (default {DEFAULT_OUT.relative_to(ROOT)})")
    ap.add_argument("--allow-cpu-smoke", action="store_true",
                    help="accept a tiny CPU run (tests of this script); needs --out")
    args = ap.parse_args(argv)
    if args.allow_cpu_smoke and args.out is None:
        print("gpu_costs_fit: --allow-cpu-smoke needs --out (a smoke run never becomes the "
              "shipped measured model)", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else DEFAULT_OUT
    try:
        data = json.loads(Path(args.json).read_text())
        if not isinstance(data, dict):
            raise FitError("the JSON is not an object")
        values, header = cost_model(data, allow_cpu_smoke=args.allow_cpu_smoke)
        write_yaml(values, header, out)
    except (OSError, json.JSONDecodeError, FitError, ConfigError, KeyError, TypeError,
            ZeroDivisionError) as e:
        print(f"gpu_costs_fit: {args.json}: {e}", file=sys.stderr)
        return 2
    print(f"gpu_costs_fit: wrote {out} ({values['name']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
