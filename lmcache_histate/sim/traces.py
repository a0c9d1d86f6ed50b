"""Trace loaders: Weka Claude Code (JSON), TraceLab CSV, Mooncake JSONL.

Each turns a source trace into ``trace_model``'s ``Trace`` (its docstring states the
model and the re-chunking rule every loader applies); ``load_trace`` picks the loader
from a path or a bundled sample's name.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import zlib
from collections.abc import Callable, Iterable
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from .trace_model import ChunkChain, HashInterner, Rechunker, Request, Session, Trace

__all__ = [
    "TraceFormatError",
    "load_mooncake",
    "load_trace",
    "load_tracelab_csv",
    "load_weka",
    "sample_trace_dir",
]


class TraceFormatError(ValueError):
    """A trace file is corrupt, truncated or does not follow its format."""


# ---------------------------------------------------------------- field validation helpers
def _num(raw: dict[str, Any], key: str, where: str, default: float | None = None) -> float:
    v = raw.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int | float) or v != v or v < 0:
        raise TraceFormatError(f"{where}.{key}: expected a non-negative number, got {v!r}")
    return float(v)


def _int(raw: dict[str, Any], key: str, where: str) -> int:
    v = raw.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise TraceFormatError(f"{where}.{key}: expected a non-negative int, got {v!r}")
    return v


def _ids(raw: dict[str, Any], key: str, where: str, tokens: int, block: int) -> list[Any]:
    v = raw.get(key)
    if not isinstance(v, list):
        raise TraceFormatError(f"{where}.{key}: expected a list of ints, got {type(v).__name__}")
    if len(v) > -(-tokens // block):  # more blocks than the input has tokens for
        raise TraceFormatError(f"{where}.{key}: {len(v)} blocks exceed input of {tokens} tokens")
    return v


def _read_bytes(path: Path) -> bytes:
    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                return f.read()
        return path.read_bytes()
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise TraceFormatError(f"{path}: truncated or corrupt gzip ({e})") from e


def _read_text(path: Path) -> str:
    try:
        return _read_bytes(path).decode()
    except UnicodeDecodeError as e:
        raise TraceFormatError(f"{path}: not UTF-8 text ({e})") from e


def _load_json(path: Path) -> Any:
    try:
        return json.loads(_read_text(path))
    except json.JSONDecodeError as e:
        raise TraceFormatError(f"{path}: invalid JSON at line {e.lineno} col {e.colno}") from e


# ---------------------------------------------------------------- Weka (Claude Code)
def _weka_paths(paths_or_dir: str | Path | Iterable[str | Path]) -> list[Path]:
    if isinstance(paths_or_dir, str | Path):
        p = Path(paths_or_dir)
        if p.is_dir():
            return sorted(q for q in p.iterdir() if q.name.endswith((".json", ".json.gz")))
        return [p]
    return sorted(Path(p) for p in paths_or_dir)


def _weka_requests(
    items: list[tuple[str, Any]], session_id: str, t0: float,
    ctx: tuple[Rechunker, HashInterner, object],
) -> list[Request]:
    """Parse one session's (label, raw) requests; ``t0`` is added to every ``t``."""
    rechunker, interner, scope = ctx
    out: list[Request] = []
    prev_t = prev_api = None
    prev: tuple[list[Any], tuple[int, ...]] = ([], ())
    for w, raw in items:
        if not isinstance(raw, dict):
            raise TraceFormatError(f"{w}: expected an object")
        t, tokens = _num(raw, "t", w), _int(raw, "in", w)
        ids = _ids(raw, "hash_ids", w, tokens, rechunker.block)
        if "think_time" in raw:
            think = _num(raw, "think_time", w)
        else:  # 47 of ~23.7K requests lack it: use the idle gap after the previous call
            think = 0.0 if prev_t is None else max(0.0, t - prev_t - (prev_api or 0.0))
        picked = rechunker.picks(ids, tokens)
        try:
            hashes = rechunker.hashes(picked, interner, scope, prev)
        except TypeError as e:
            raise TraceFormatError(f"{w}.hash_ids: {e}") from e
        prev = (picked, hashes)
        out.append(Request(session_id, len(out), t0 + t, think, tokens, _int(raw, "out", w),
                           hashes, kind=_input_kind(raw)))
        api = raw.get("api_time")
        prev_t, prev_api = t, api if isinstance(api, int | float) else None
    return out


def _input_kind(raw: dict[str, Any]) -> str | None:
    """The content kind of a request's new input: its ``input_types``, sorted and joined
    (e.g. ``"tool_result"``, ``"text,tool_result,tool_use"``); None where absent."""
    types = raw.get("input_types")
    if not isinstance(types, list) or not types:
        return None
    return ",".join(sorted({str(t) for t in types}))


def _weka_max_input(entries: list[Any]) -> int:
    """Largest ``in`` over main and subagent requests, for the size filter. Malformed
    entries count as 0 here; they are reported when a kept file is parsed."""
    raws = [*entries, *(r for e in entries if isinstance(e, dict) and e.get("type") ==
                        "subagent" and isinstance(e.get("requests"), list) for r in e["requests"])]
    ins = (r.get("in") for r in raws if isinstance(r, dict))
    return max((v for v in ins if isinstance(v, int)), default=0)


def load_weka(
    paths_or_dir: str | Path | Iterable[str | Path],
    chunk_tokens: int,
    *,
    max_input_tokens: int | None = None,
    session_gap: float = 0.0,
    start_offsets: Literal["zero", "staggered"] = "staggered",
    progress: Callable[[int, int], None] | None = None,
    name: str | None = None,
    keep: Callable[[str], bool] | None = None,
) -> Trace:
    """Load Weka Claude Code traces (one gzip'd JSON file = one conversation).

    Main session id = file stem; each ``type: "subagent"`` entry becomes a session
    ``f"{stem}/{agent_id}"`` with parent = the main session. Nested subagent ``t`` are
    RELATIVE to the subagent entry's own ``t`` (in the data every subagent starts at
    0.0 and ends within ``duration_ms``), so request arrival = file offset + subagent
    t + nested t. Files are independent sessions each starting at 0; the k-th KEPT file
    (sorted by path, after ``max_input_tokens`` filtering) gets offset k*session_gap
    ("staggered"); "zero" puts all at 0. ``max_input_tokens`` keeps only files whose
    largest input (main and subagents) is ≤ it; ``keep(stem)``, if given, keeps only the
    files whose main session id it accepts (both before the staggering: a kept subset
    starts as densely as a whole folder). ``progress(done, total)`` per file.
    """
    if start_offsets not in ("zero", "staggered") or (start_offsets == "zero" and session_gap):
        raise ValueError(f"start_offsets={start_offsets!r} with session_gap={session_gap}: "
                         "use 'staggered' (k*session_gap) or 'zero' (no gap)")
    paths = _weka_paths(paths_or_dir)
    if keep is not None:
        paths = [p for p in paths if keep(p.name.removesuffix(".gz").removesuffix(".json"))]
    interner, rechunkers = HashInterner(), {}
    sessions: list[Session] = []
    kept = 0
    for done, path in enumerate(paths, 1):
        doc = _load_json(path)
        entries = doc.get("requests") if isinstance(doc, dict) else None
        if not isinstance(entries, list):
            raise TraceFormatError(f"{path}: missing or invalid 'requests' list")
        if max_input_tokens is None or _weka_max_input(entries) <= max_input_tokens:
            sessions.extend(_weka_file(path, doc, entries, chunk_tokens, interner, rechunkers,
                                       kept * session_gap))
            kept += 1
        if progress is not None:
            progress(done, len(paths))
    if name is None:
        name = paths[0].parent.name if paths else "weka"
    return Trace(name, chunk_tokens, tuple(sessions))


def _weka_file(
    path: Path, doc: dict[str, Any], entries: list[Any], chunk_tokens: int,
    interner: HashInterner, rechunkers: dict[int, Rechunker], offset: float,
) -> list[Session]:
    block = doc.get("block_size", 64)
    if isinstance(block, bool) or not isinstance(block, int) or block <= 0:
        raise TraceFormatError(f"{path}: block_size: expected a positive int, got {block!r}")
    scope = ("weka", block) if doc.get("hash_id_scope") == "global" else (str(path), block)
    ctx = (rechunkers.setdefault(block, Rechunker(block, chunk_tokens)), interner, scope)
    main_id = path.name.removesuffix(".gz").removesuffix(".json")
    main_raw, sessions = [], []
    for i, e in enumerate(entries):
        if not (isinstance(e, dict) and e.get("type") == "subagent"):
            main_raw.append((f"{path}: requests[{i}]", e))
            continue
        where = f"{path}: requests[{i}]"
        agent, nested = e.get("agent_id"), e.get("requests")
        if not isinstance(agent, str):
            raise TraceFormatError(f"{where}.agent_id: expected a string, got {agent!r}")
        if not isinstance(nested, list):
            raise TraceFormatError(f"{where}.requests: expected a list")
        sid = f"{main_id}/{agent}"
        if any(s.id == sid for s in sessions):
            raise TraceFormatError(f"{where}.agent_id: duplicate {agent!r}")
        items = [(f"{where}.requests[{j}]", r) for j, r in enumerate(nested)]
        reqs = _weka_requests(items, sid, offset + _num(e, "t", where), ctx)
        sessions.append(Session(sid, main_id, tuple(reqs)))
    main = _weka_requests(main_raw, main_id, offset, ctx)
    return [Session(main_id, None, tuple(main)), *sessions]


# ---------------------------------------------------------------- TraceLab CSV
_TL_COLS = ("arrival_time", "round_idx", "prefix_len", "input_len", "output_len",
            "tool_wait_after_ms")


def load_tracelab_csv(path: str | Path, chunk_tokens: int) -> Trace:
    """Load a TraceLab multi-round CSV (canonical ``csv_export`` columns; ``id`` or
    ``session_id``).

    Per the export's docs ``prefix_len`` is the reused (cached) context and ``input_len``
    the newly appended prompt, so round r's prompt has prefix_len + input_len tokens:
    the first prefix_len tokens of the session's context (the previous prompt followed
    by its output), then input_len fresh tokens. Chunk ids come from a ``ChunkChain``:
    chunks within the kept prefix keep their ids, every other chunk (covering new
    tokens, or a prefix_len beyond the existing context, e.g. the first round's prefix,
    which has no source in the session) gets a fresh id. After the round, output_len fresh
    tokens extend the context. ``arrival_time`` (ms) is per session in the export: the
    round-0 arrival; round r > 0 arrives after the previous round's
    ``tool_wait_after_ms`` (its ``think_time``), placed at session start + the sum of
    the waits (zero service time; a closed-loop simulator should use ``think_time``).
    """
    path = Path(path)
    reader = csv.DictReader(io.StringIO(_read_text(path)))
    fields = reader.fieldnames or []
    sid_col = "session_id" if "session_id" in fields else "id"
    missing = [c for c in (sid_col, *_TL_COLS) if c not in fields]
    if missing:
        raise TraceFormatError(f"{path}: missing columns {missing}")
    rows: dict[str, list[dict[str, float]]] = {}
    for row in reader:
        where = f"{path}: line {reader.line_num}"
        try:
            vals = {c: float(row[c]) for c in _TL_COLS}
        except (TypeError, ValueError) as e:
            raise TraceFormatError(f"{where}: bad number ({e})") from e
        bad = [c for c, v in vals.items() if not v >= 0 or (c in _TL_COLS[1:5] and v % 1)]
        if bad:
            raise TraceFormatError(f"{where}, column {bad[0]}: expected a non-negative int")
        rows.setdefault(row[sid_col], []).append(vals)
    interner, sessions = HashInterner(), []
    for sid, rs in rows.items():
        rs.sort(key=lambda v: v["round_idx"])
        chain, clock, think = ChunkChain(chunk_tokens, interner), rs[0]["arrival_time"] / 1e3, 0.0
        reqs: list[Request] = []
        for v in rs:
            prefix, new, out = int(v["prefix_len"]), int(v["input_len"]), int(v["output_len"])
            chain.truncate(prefix)
            chain.append_fresh(prefix + new - chain.length)
            clock += think
            reqs.append(Request(sid, len(reqs), clock, think, prefix + new, out, tuple(chain.ids)))
            chain.append_fresh(out)
            think = v["tool_wait_after_ms"] / 1e3
        sessions.append(Session(sid, None, tuple(reqs)))
    return Trace(path.name.split(".")[0], chunk_tokens, tuple(sessions))


# ---------------------------------------------------------------- Mooncake JSONL
def load_mooncake(path: str | Path, chunk_tokens: int, *, block_tokens: int = 512) -> Trace:
    """Load a Mooncake JSONL(.gz) trace: one single-request session per line.

    ``timestamp`` is in ms; hash ids are chained 512-token blocks in one global scope.
    Mooncake lists the partial last block too; the re-chunking rule drops it.
    """
    path = Path(path)
    lines = _read_text(path).splitlines()
    rechunker, interner, sessions = Rechunker(block_tokens, chunk_tokens), HashInterner(), []
    stem = path.name.split(".")[0]
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}: line {n}"
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceFormatError(f"{where}: invalid JSON ({e.msg})") from e
        if not isinstance(raw, dict):
            raise TraceFormatError(f"{where}: expected an object")
        tokens = _int(raw, "input_length", where)
        ids = _ids(raw, "hash_ids", where, tokens, block_tokens)
        try:
            hashes = rechunker.hashes(rechunker.picks(ids, tokens), interner, "mooncake")
        except TypeError as e:
            raise TraceFormatError(f"{where}.hash_ids: {e}") from e
        sid = f"{stem}/{len(sessions)}"
        req = Request(sid, 0, _num(raw, "timestamp", where) / 1e3, 0.0, tokens,
                      _int(raw, "output_length", where), hashes)
        sessions.append(Session(sid, None, (req,)))
    return Trace(stem, chunk_tokens, tuple(sessions))


# ---------------------------------------------------------------- dispatch + sample
def sample_trace_dir() -> Path:
    """The embedded Weka sample (6 small files, Apache-2.0; see its LICENSE-NOTE.md)."""
    return Path(str(resources.files("lmcache_histate") / "data" / "traces" / "weka-sample"))


def load_trace(spec: str | Path, chunk_tokens: int, **kw: Any) -> Trace:
    """Load by spec: "weka-sample", a directory (Weka), ``*.csv`` (TraceLab),
    ``*.jsonl[.gz]`` (Mooncake) or ``*.json[.gz]`` (one Weka file)."""
    if str(spec) in ("weka-sample", "sample"):
        return load_weka(sample_trace_dir(), chunk_tokens, name="weka-sample", **kw)
    p = Path(spec)
    if not p.exists():
        raise FileNotFoundError(f"trace not found: {p}")
    name = p.name.removesuffix(".gz")
    if p.is_dir() or name.endswith(".json"):
        return load_weka(p, chunk_tokens, **kw)
    if name.endswith(".csv"):
        return load_tracelab_csv(p, chunk_tokens, **kw)
    if name.endswith(".jsonl"):
        return load_mooncake(p, chunk_tokens, **kw)
    raise ValueError(f"unknown trace format: {p}")
