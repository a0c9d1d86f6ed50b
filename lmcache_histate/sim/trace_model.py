"""The trace data model and chunk identities, shared by every loader and the synthetic
traces.

Every loader turns a source trace into the same model: a ``Trace`` of ``Session``s of
``Request``s, each carrying the chained hashes of the FULL chunks of its input at the
simulator's chunk size ``Trace.chunk_tokens`` (C). Hash values are dense ints from a
per-Trace interner, so they are unique across the Trace for different prefixes and
never collide across files.

Re-chunking rule (Weka: 64-token source blocks, Mooncake: 512). A source trace lists one
chained id per source block of B tokens (equal id <=> equal prefix through that block).
Chunk i covers tokens [i*C, (i+1)*C); its identity is the source id of the block that
holds its LAST token, (i+1)*C - 1. A prefix match through that block implies a match
through the chunk end; when two inputs diverge inside that block but after the chunk
end the chunk is wrongly treated as different, i.e. the rule is conservative (never
claims a hit that is not there). Only full source blocks count: n_full =
min(len(hash_ids), input_tokens // B) (Mooncake also lists the partial last block);
chunks ending past n_full * B are not hashed, so a partial tail is always recomputed.
The interner key is (scope, B, id * B + offset of the chunk end inside the block): the
offset keeps chunks apart when C < B (several chunks end in one block); when B divides
C it is constant and dropped. Weka ids are local to a file, so scope = the file
(subagents share it: they use the file's id space); Mooncake has one global scope.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["ChunkChain", "HashInterner", "Rechunker", "Request", "Session", "Trace"]


@dataclass(frozen=True, slots=True)
class Request:
    """One model call. ``arrival`` is the trace's own absolute timestamp (seconds)."""

    session_id: str
    index: int
    arrival: float
    think_time: float
    input_tokens: int
    output_tokens: int
    chunk_hashes: tuple[int, ...]
    rewrite: bool = False  # synthetic traces: this request rewrote earlier context
    kind: str | None = None  # content kind of its new input (Weka: sorted input_types)


@dataclass(frozen=True, slots=True)
class Session:
    """One conversation (or one subagent of it, then ``parent`` is the main session id)."""

    id: str
    parent: str | None
    requests: tuple[Request, ...]

    @property
    def max_input_tokens(self) -> int:
        return max((r.input_tokens for r in self.requests), default=0)


@dataclass(frozen=True, slots=True)
class Trace:
    name: str
    chunk_tokens: int
    sessions: tuple[Session, ...]

    def __post_init__(self) -> None:
        ids = [s.id for s in self.sessions]
        if len(set(ids)) != len(ids):
            raise ValueError(f"trace {self.name!r}: duplicate session ids")

    def requests(self) -> list[Request]:
        """All requests by arrival; ties keep session order then request order."""
        return sorted((r for s in self.sessions for r in s.requests), key=lambda r: r.arrival)

    @property
    def num_requests(self) -> int:
        return sum(len(s.requests) for s in self.sessions)

    def max_input_tokens(self) -> dict[str, int]:
        """Largest input per session id."""
        return {s.id: s.max_input_tokens for s in self.sessions}

    def filter_sessions(self, pred: Callable[[Session], bool]) -> Trace:
        return Trace(self.name, self.chunk_tokens, tuple(s for s in self.sessions if pred(s)))


class HashInterner:
    """Dense ints for (scope, source key) pairs, plus fresh ids that match nothing."""

    def __init__(self) -> None:
        self._scopes: dict[object, dict[int, int]] = {}
        self._next = 0

    def fresh(self) -> int:
        self._next += 1
        return self._next - 1

    def intern(self, scope: object, keys: Iterable[int]) -> tuple[int, ...]:
        table = self._scopes.setdefault(scope, {})
        out = []
        for key in keys:
            v = table.get(key)
            if v is None:
                v = table[key] = self._next
                self._next += 1
            out.append(v)
        return tuple(out)


class Rechunker:
    """Applies the module's re-chunking rule for one (B, C) pair; index plans are cached."""

    def __init__(self, block_tokens: int, chunk_tokens: int) -> None:
        if block_tokens <= 0 or chunk_tokens <= 0:
            raise ValueError("block and chunk sizes must be positive")
        self.block, self.chunk = block_tokens, chunk_tokens
        self._stride = chunk_tokens // block_tokens if chunk_tokens % block_tokens == 0 else 0
        self._blocks: list[int] = []  # source block index holding chunk i's last token
        self._offsets: list[int] = []  # position of that token inside the block

    def picks(self, source_ids: list[Any], input_tokens: int) -> list[Any]:
        """Source id identifying each full chunk of one input (see module docstring)."""
        m = min(len(source_ids), input_tokens // self.block) * self.block // self.chunk
        if self._stride:
            return source_ids[self._stride - 1 : m * self._stride : self._stride]
        while len(self._blocks) < m:
            end = (len(self._blocks) + 1) * self.chunk - 1
            self._blocks.append(end // self.block)
            self._offsets.append(end % self.block)
        return [source_ids[j] for j in self._blocks[:m]]

    def hashes(
        self, picked: list[Any], interner: HashInterner, scope: object,
        prev: tuple[list[Any], tuple[int, ...]] = ([], ()),
    ) -> tuple[int, ...]:
        """Interned chunk hashes. ``prev`` = (picks, hashes) of the session's previous
        request: ~98 % of agent requests extend it, so its hashes are reused and only
        the new tail is checked and interned (a 2x speed-up on the Weka set)."""
        p = len(prev[0])
        start, head = (p, prev[1]) if p and picked[:p] == prev[0] else (0, ())
        tail = picked[start:]
        if not all(type(x) is int for x in tail):
            raise TypeError("hash ids must be ints")
        if not self._stride:
            b = self.block
            tail = [x * b + o for x, o in zip(tail, self._offsets[start:], strict=False)]
        return head + interner.intern(scope, tail)


class ChunkChain:
    """Chunk ids of an evolving token sequence known only as kept prefix + fresh tokens.

    Used where a source has lengths but no hashes (TraceLab, synthetic traces): a chunk
    keeps its id while the prefix through its end is kept; any chunk that includes a
    fresh token is a new prefix and gets a fresh id.
    """

    def __init__(self, chunk_tokens: int, interner: HashInterner) -> None:
        self.chunk, self._interner = chunk_tokens, interner
        self.length = 0
        self.ids: list[int] = []

    def truncate(self, tokens: int) -> None:
        """Keep the first ``tokens`` tokens (no-op beyond the current length)."""
        self.length = min(self.length, tokens)
        del self.ids[self.length // self.chunk :]

    def append_fresh(self, tokens: int) -> None:
        self.length += tokens
        while len(self.ids) < self.length // self.chunk:
            self.ids.append(self._interner.fresh())
