"""The demo's workload: the bundled Weka sample scaled down to a CPU-sized replay.

Each 64-token trace block becomes ``block_tokens`` synthetic tokens drawn from a
generator seeded by (session file, block hash id): prompts share exactly as many leading
blocks as in the trace (continuations and rewrites alike), while a 20K-token Claude Code
context fits the tiny model's context.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LO_TOKEN", "SOURCE_BLOCK", "DemoRequest", "build_workload", "reachable_hit_tokens",
           "unique_chunks"]

SOURCE_BLOCK = 64
"""Tokens per hash id in Weka traces."""
LO_TOKEN = 4
"""First token id used (0-3 are the tiny tokenizer's special tokens)."""


@dataclass(frozen=True)
class DemoRequest:
    session: str
    turn: int
    arrival: float
    prompt: tuple[int, ...]
    source_tokens: int
    """The request's input length in the trace (before scaling)."""


def _block_tokens(scope: str, block_id: int, n: int, vocab: int, seed: int) -> list[int]:
    digest = hashlib.blake2b(f"{seed}:{scope}:{block_id}".encode(), digest_size=8).digest()
    rng = random.Random(int.from_bytes(digest, "little"))
    return [rng.randrange(LO_TOKEN, vocab) for _ in range(n)]


def build_workload(
    *,
    sessions: int,
    requests: int,
    block_tokens: int,
    max_prompt_tokens: int,
    vocab: int,
    seed: int = 0,
    trace_dir: Path | None = None,
) -> list[DemoRequest]:
    """The replay: the first ``requests`` requests of the first ``sessions`` main sessions
    (by file name) of the Weka sample, in arrival order (all sessions start at 0)."""
    from lmcache_histate.sim.traces import load_weka, sample_trace_dir

    # chunk_tokens = the source block size: one interned hash per full source block, scoped
    # per file (load_weka interns (file, id)), i.e. per (session scope, block hash).
    trace = load_weka(trace_dir or sample_trace_dir(), SOURCE_BLOCK, start_offsets="zero")
    mains = [s for s in trace.sessions if s.parent is None][:sessions]
    out: list[DemoRequest] = []
    for session in mains:
        scope = session.id.split("/")[0]
        for request in session.requests[:requests]:
            hashed = list(request.chunk_hashes)
            prompt: list[int] = []
            for block in hashed:
                prompt += _block_tokens(scope, block, block_tokens, vocab, seed)
            rest = request.input_tokens - len(hashed) * SOURCE_BLOCK
            tail = max(1, round(rest * block_tokens / SOURCE_BLOCK))
            prompt += _block_tokens(f"{scope}#tail", request.index, tail, vocab, seed)
            if len(prompt) > max_prompt_tokens:
                break  # this and the session's later requests do not fit the context
            out.append(DemoRequest(session.id, request.index, request.arrival, tuple(prompt),
                                   request.input_tokens))
    out.sort(key=lambda r: (r.arrival, r.session, r.turn))
    return out


def _prefix_digests(prompt: Sequence[int], chunk: int) -> list[bytes]:
    """One digest per full ``chunk``-token block of ``prompt``, each naming the whole prefix
    up to that block's end."""
    h = hashlib.blake2b(digest_size=16)
    out = []
    for i in range(len(prompt) // chunk):
        h.update(json.dumps(list(prompt[i * chunk:(i + 1) * chunk])).encode())
        out.append(h.copy().digest())
    return out


def reachable_hit_tokens(workload: Sequence[DemoRequest], chunk: int) -> list[int]:
    """Per request, in workload order: the prompt tokens a cache that never evicts and keeps
    a state at every ``chunk`` boundary of every earlier prompt could resume from.

    That is the request's longest common prefix with any earlier prompt, capped at its
    length minus one (an engine computes at least the last prompt token to sample from it)
    and floored to whole chunks (states exist at chunk boundaries only). No stack can hit
    more, so a stack at this count has nothing left for a better policy to win."""
    seen: set[bytes] = set()
    out = []
    for request in workload:
        digests = _prefix_digests(request.prompt, chunk)
        usable = (len(request.prompt) - 1) // chunk
        shared = 0
        while shared < min(usable, len(digests)) and digests[shared] in seen:
            shared += 1
        out.append(shared * chunk)
        seen.update(digests)
    return out


def shareable_hit_tokens(workload: Sequence[DemoRequest], chunk: int) -> list[int]:
    """Per request, in workload order: the prompt tokens it shares with a prompt of another
    session or with an earlier turn of its own, in whole ``chunk``-token chunks and capped at
    its length minus one.

    A replay runs sessions concurrently and each session's turns in order, so a request may
    resume a prefix that another session's prompt, later in workload order, stored first,
    but never one of its own later turns. No request of a replay that starts on an empty
    cache can resume more than this, whatever order the sessions' requests interleave in;
    more means the cache held something the replay did not put there."""
    prompts = [_prefix_digests(request.prompt, chunk) for request in workload]
    first_turn: dict[bytes, dict[str, int]] = {}  # prefix -> session -> its first turn holding it
    for request, digests in zip(workload, prompts, strict=True):
        for d in digests:
            turns = first_turn.setdefault(d, {})
            turns[request.session] = min(turns.get(request.session, request.turn), request.turn)

    def held_before(d: bytes, request: DemoRequest) -> bool:
        return any(session != request.session or turn < request.turn
                   for session, turn in first_turn[d].items())

    out = []
    for request, digests in zip(workload, prompts, strict=True):
        usable = min((len(request.prompt) - 1) // chunk, len(digests))
        shared = 0  # a prefix held elsewhere: so are all of its shorter prefixes
        while shared < usable and held_before(digests[shared], request):
            shared += 1
        out.append(shared * chunk)
    return out


def unique_chunks(workload: Sequence[DemoRequest], chunk: int) -> int:
    """Distinct full ``chunk``-token chunks (by prefix) over the workload: what a cache could
    hold (``chunk`` = the engine's block size on this machine)."""
    seen: set[bytes] = set()
    for request in workload:
        seen.update(_prefix_digests(request.prompt, chunk))
    return len(seen)
