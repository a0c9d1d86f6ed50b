"""Synthetic agent traces with controlled mid-turn context rewriting.

Model: each session has a system prompt of ``system_tokens`` and then one turn per
request; turn k appends ``new_tokens_per_turn`` (N) fresh tokens, so request k's input
is system_tokens + (k+1)*N tokens. The previous response counts as part of the next
turn's new tokens, so ``output_tokens`` does not grow the context (what is fresh in a
real replay is the same: the tool result and the response both follow the prefix).

A rewriting request (k ≥ 1) keeps a prefix of the earlier context that ends at a
uniformly random position strictly INSIDE an earlier turn (never at a turn boundary and
never inside the system prompt: agents edit tool output and messages, not the system
prompt), replaces the rest of the earlier context with fresh tokens of the same length
and then appends its own turn; later turns build on the rewritten context. Which
earlier turn is ``rewrite_scope``:

* ``"last"`` (the default): the most recent one, the turn request k−1 appended. This is
  where Claude Code cuts: in the Weka folder, 1,237 of the 1,578 requests that rewrite
  their predecessor's context (78 %) cut inside its most recent turn, 30 reset to
  nothing, 265 cut ≥ 10 turns back (``sim.rewrite_stats``; ``benchmarks/sim_weka.md``,
  "sim_rewrite").
  Inside the turn the measured cut is late (median offset 0.875); the offset here stays
  uniform, which gives a finer resume point less to win than the measured one would.
* ``"any"``: a uniformly drawn earlier turn (0..k−1), the model of the first rewrite
  tests: the cut is then on average half the context back and most of a rewriting
  request is new tokens whatever the cache holds.

Exactly round(rewrite_share × eligible requests) requests rewrite, sampled
without replacement from all requests k ≥ 1 of all sessions, so each has probability
``rewrite_share`` and the realised share is exact (the paper sweeps 0–10 %).

Timing: session s starts at s * session_gap; request k has think_time = ``think_time``
(0 for k = 0) and nominal arrival start + k * think_time (zero service time; a
closed-loop simulator should schedule from ``think_time``).
"""

from __future__ import annotations

import random

from lmcache_histate.sim.trace_model import ChunkChain, HashInterner, Request, Session, Trace

REWRITE_SCOPES = ("last", "any")


def synthetic_agent(
    num_sessions: int,
    turns: int,
    new_tokens_per_turn: int,
    rewrite_share: float,
    *,
    chunk_tokens: int,
    seed: int,
    think_time: float = 2.0,
    output_tokens: int = 256,
    system_tokens: int = 0,
    session_gap: float = 0.0,
    name: str | None = None,
    rewrite_scope: str = "last",
) -> Trace:
    """Build a deterministic synthetic agent trace (see the module docstring)."""
    if not 0.0 <= rewrite_share <= 1.0:
        raise ValueError(f"rewrite_share must be in [0, 1], got {rewrite_share}")
    if rewrite_scope not in REWRITE_SCOPES:
        raise ValueError(f"rewrite_scope must be one of {REWRITE_SCOPES}, got {rewrite_scope!r}")
    if num_sessions < 0 or turns < 0 or system_tokens < 0 or chunk_tokens <= 0:
        raise ValueError("sizes must be non-negative and chunk_tokens positive")
    if new_tokens_per_turn < 2:
        raise ValueError("new_tokens_per_turn must be ≥ 2 to have positions inside a turn")
    rng = random.Random(seed)
    eligible = [(s, k) for s in range(num_sessions) for k in range(1, turns)]
    rewriting = set(rng.sample(eligible, round(rewrite_share * len(eligible))))
    interner = HashInterner()
    n = new_tokens_per_turn
    sessions = []
    for s in range(num_sessions):
        sid = f"syn{s:03d}"
        chain = ChunkChain(chunk_tokens, interner)
        chain.append_fresh(system_tokens)
        start = s * session_gap
        reqs = []
        for k in range(turns):
            rewrite = (s, k) in rewriting
            if rewrite:
                # A position strictly inside turn k-1 ("last") or one of 0..k-1 ("any").
                turn = k - 1 if rewrite_scope == "last" else rng.randrange(k)
                cut = system_tokens + turn * n + rng.randrange(1, n)
                earlier = chain.length
                chain.truncate(cut)
                chain.append_fresh(earlier - cut)
            chain.append_fresh(n)
            reqs.append(
                Request(
                    session_id=sid,
                    index=k,
                    arrival=start + k * think_time,
                    think_time=think_time if k else 0.0,
                    input_tokens=chain.length,
                    output_tokens=output_tokens,
                    chunk_hashes=tuple(chain.ids),
                    rewrite=rewrite,
                )
            )
        sessions.append(Session(sid, None, tuple(reqs)))
    if name is None:
        name = f"synthetic-{num_sessions}x{turns}x{n}-rw{rewrite_share:g}-{rewrite_scope}-s{seed}"
    return Trace(name, chunk_tokens, tuple(sessions))


def paper_rewrite_trace(
    rewrite_share: float,
    seed: int,
    chunk_tokens: int,
    *,
    num_sessions: int = 24,
    turns: int = 16,
    new_tokens: int = 8192,
    rewrite_scope: str = "last",
) -> Trace:
    """The paper's rewrite test: ``turns`` turns × ``new_tokens`` new tokens per session
    (the paper's 16 × 8K), a share of rewriting requests (the paper sweeps 0–10 %);
    24 sessions matches its ≤24 concurrent. README quotes these defaults
    (``benchmarks/claims.py`` renders them)."""
    return synthetic_agent(
        num_sessions,
        turns,
        new_tokens,
        rewrite_share,
        chunk_tokens=chunk_tokens,
        seed=seed,
        rewrite_scope=rewrite_scope,
        name=f"paper-rewrite-{rewrite_share:g}-{rewrite_scope}-s{seed}",
    )
