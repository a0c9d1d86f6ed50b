"""Two disjoint halves of a trace's sessions: the check that a comparison carries.

A comparison between rows that holds on a trace might hold only because of a few of its
sessions. Every comparative claim of the simulator's pages is therefore checked on two
disjoint halves of the shared sessions as well (``benchmarks/claims.py``): a row is
"ahead" only where it is ahead beyond the spread on the whole set and on both halves.

Rule: a root session (a Weka file: its main conversation and its subagents together)
belongs to half ``a`` if the CRC-32 of its id (the file name without ``.json.gz``, e.g.
``trace_0002``) is even, to ``b`` if odd. The rule reads nothing but the id, so it
splits any folder the same way, sessions not yet seen included, and it does not follow
the file numbering (the shared folder holds even numbers only). On the shared Weka
subset ≤ 100K tokens it gives 42 sessions / 956 requests and 41 / 901.

Example: ``zlib.crc32(b"trace_0002")`` = 1,170,861,099 (odd): half ``b``.
"""

from __future__ import annotations

import zlib

__all__ = ["HALVES", "in_half"]

HALVES = ("a", "b")


def in_half(session_id: str, half: str) -> bool:
    """Whether the root session ``session_id`` belongs to ``half`` (module doc)."""
    if half not in HALVES:
        raise ValueError(f"half must be one of {', '.join(HALVES)}, got {half!r}")
    return zlib.crc32(session_id.encode()) % 2 == HALVES.index(half)
