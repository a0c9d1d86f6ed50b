"""Where agents rewrite their context: the divergence points of consecutive requests.

The synthetic rewrite test (``synthetic``) must put its cuts where real agents put
theirs, so this module measures them in a trace.

**Definitions.** In one session, request ``k`` *appended* the chunks
``[s_k, n_k)``: ``n_k`` is its prompt length and ``s_k`` the common prefix of its prompt
with request ``k−1``'s (``s_0 = 0``). Request ``k`` *rewrites* when ``s_k < n_{k−1}``: it
kept only a prefix of its predecessor's context and continued differently from
``c = s_k``. ``c = 0`` is a *reset* (nothing kept). Otherwise the cut lies in the turn of
the latest request ``j < k`` whose appended span contains it (``s_j ≤ c < n_j``);
``turns back = (k − 1) − j`` (0: inside the most recent turn, the one request ``k−1``
appended) and its *offset* is ``(c − s_j) / (n_j − s_j)`` in ``[0, 1)``.

Invariants: every rewrite that is not a reset has exactly one ``turns back`` and one
offset (the spans of requests ``0..k−1`` cover ``[0, n_{k−1})``, since ``s_j ≤ n_{j−1}``);
``rewrites = resets + sum(turns_back.values())``.

Positions are counted in the trace's chunks: load a Weka trace with ``chunk_tokens = 64``
to measure at its native block size.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from .trace_model import Request, Session, Trace

__all__ = ["RewriteStats", "common_prefix", "rewrite_stats", "rewriting_requests"]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two chunk-hash chains."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(slots=True)
class RewriteStats:
    """Counts over every session of a trace (module docstring)."""

    requests: int = 0
    rewrites: int = 0
    resets: int = 0
    turns_back: Counter[int] = field(default_factory=Counter)
    last_turn_offsets: list[float] = field(default_factory=list)

    @property
    def last_turn_share(self) -> float:
        """Share of the rewrites (resets included) that cut inside the most recent turn."""
        return self.turns_back[0] / self.rewrites if self.rewrites else 0.0


def _appended(session: Session) -> Iterator[tuple[Request, int, bool]]:
    """Each request of ``session`` with ``s_k`` (the start of the span it appended) and
    whether it rewrites (``s_k < n_{k−1}``; module docstring)."""
    prev: tuple[int, ...] | None = None
    for request in session.requests:
        chain = request.chunk_hashes
        if prev is None:
            yield request, 0, False
        else:
            start = common_prefix(prev, chain)
            yield request, start, start < len(prev)
        prev = chain


def rewriting_requests(trace: Trace) -> set[tuple[str, int]]:
    """``(session id, index)`` of every request ``rewrite_stats`` counts as a rewrite
    (resets included)."""
    return {
        (request.session_id, request.index)
        for session in trace.sessions
        for request, _, rewrites in _appended(session)
        if rewrites
    }


def rewrite_stats(trace: Trace) -> RewriteStats:
    """Measure where the requests of ``trace`` rewrite their predecessors' context."""
    out = RewriteStats()
    for session in trace.sessions:
        spans: list[tuple[int, int]] = []  # (s_j, n_j) per request so far
        for request, start, rewrites in _appended(session):
            out.requests += 1
            if rewrites:
                out.rewrites += 1
                if start == 0:
                    out.resets += 1
                else:
                    back, (lo, hi) = next(
                        (b, span)
                        for b, span in enumerate(reversed(spans))
                        if span[0] <= start < span[1]
                    )
                    out.turns_back[back] += 1
                    if back == 0:
                        out.last_turn_offsets.append((start - lo) / (hi - lo))
            spans.append((start, len(request.chunk_hashes)))
    return out
