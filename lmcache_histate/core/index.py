"""The prefix index: which chunks of which prefixes are cached, and where.

A prefix is a chain of chunk hashes (one chunk = one engine block, e.g. 528 tokens;
hash ``i`` identifies the whole prefix up to the end of chunk ``i``), so the chains of all
cached prompts form a tree: rewrites and shared system prompts branch off shared chunks.
Each node may hold the attention KV of its chunk and a recurrent-state snapshot taken at
the chunk's end, each resident on one or more tiers (a bitmask: bit ``t`` = tier ``t``).

Invariants (checked by ``check()``; the property tests run it after every operation):
  * KV is prefix-closed: a node with KV has a parent with KV (or is a root chunk). KV
    past a gap could never be matched, so it is never stored.
  * A snapshot is only held where the chunk's KV is held: a hit at chunk ``i`` needs the
    KV of chunks ``0..i`` *and* the state after chunk ``i``.
  * ``kv_children`` counts the children holding KV, so KV leaves are O(1) to recognise.
  * ``weight`` = Σ 1/P_s over the sessions s whose path (root … session node) passes
    through the node, P_s the session's context length: the density of internal hits;
    ``passes`` = the number of those sessions (the end hits that can resume from the
    node once everything below it is gone; ``rank.expected_recompute``).
  * Whatever changes a node's ``weight``, ``passes`` or ``ends`` resets ``rank_stamp``
    on the whole session path it changes (``set_session``, ``drop_session``): the
    eviction queue does not re-rank for it, and must not trust those ranks
    (``eviction`` NOTE 4). ``prune`` moves ends without a reset: see there.
  * Empty nodes (no KV, no snapshot, no children) are pruned; a session whose node is
    pruned moves to the parent, so a session's node is its deepest live node.

A hit on a chain is the deepest chunk that holds a snapshot within the KV match: the
engine resumes from that state and recomputes everything after it.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from .hit_positions import SegmentLog

__all__ = ["ChainError", "Match", "Node", "PrefixIndex", "Session", "bits"]


class ChainError(ValueError):
    """A chain of chunk hashes contradicts the tree (a hash seen under another parent)."""


class Node:
    """One chunk of one prefix. ``end_tokens`` = tokens of the prefix up to its end."""

    __slots__ = (
        "access",
        "children",
        "depth",
        "ends",
        "key",
        "kv_bytes",
        "kv_children",
        "kv_since",
        "kv_tiers",
        "parent",
        "passes",
        "pins",
        "rank_stamp",
        "seg_offset",
        "snap_bytes",
        "snap_since",
        "snap_tiers",
        "used",
        "weight",
    )

    def __init__(self, key: int, parent: Node | None, depth: int) -> None:
        self.key = key
        self.parent = parent
        self.depth = depth
        self.children: dict[int, Node] | None = None
        self.kv_tiers = 0
        self.kv_bytes = 0
        self.kv_children = 0
        self.kv_since = 0.0
        self.snap_tiers = 0
        self.snap_bytes = 0
        self.snap_since = 0.0
        self.weight = 0.0
        self.passes = 0
        self.ends: set[Session] | None = None
        self.access = 0.0
        # When its snapshot was last stored or resumed from (``eviction`` NOTE 6): a
        # refresh of the prefix through it writes ``access``, not this.
        self.used = 0.0
        self.pins = 0
        # Where its snapshot sits in its segment, in (0, 1] (1 = the segment's end);
        # -1 = not known (``hit_positions``, ``rank.expected_recompute``).
        self.seg_offset = -1.0
        # What its queued ranks were computed from (``eviction`` NOTE 4): the queue's
        # epoch and its ``access`` then; None: never, or no longer trusted. One slot, not
        # two: a node stays in its allocator size class (a 19th slot made every lookup,
        # which reads no stamp, 2-4 % slower at 100K nodes).
        self.rank_stamp: tuple[int, float] | None = None

    def __repr__(self) -> str:
        return (
            f"Node(key={self.key}, depth={self.depth}, kv={self.kv_tiers:b}, "
            f"snap={self.snap_tiers:b})"
        )

    @property
    def has_kv(self) -> bool:
        return self.kv_tiers != 0

    @property
    def has_snapshot(self) -> bool:
        return self.snap_tiers != 0

    def path(self) -> Iterator[Node]:
        """This node and its ancestors, deepest first (the root sentinel excluded)."""
        node: Node | None = self
        while node is not None and node.depth >= 0:
            yield node
            node = node.parent


class Session:
    """A conversation: its context length, the deepest live node of its prefix, and
    when a request of it last read the cache (``last_access``, None until one did)."""

    __slots__ = ("end_tokens", "id", "last_access", "node", "segments")

    def __init__(self, sid: str, node: Node, end_tokens: int) -> None:
        self.id = sid
        self.node = node
        self.end_tokens = end_tokens
        self.last_access: float | None = None
        self.segments = SegmentLog()  # where its context's segments start (hit_positions)

    def __repr__(self) -> str:
        return f"Session({self.id!r}, end_tokens={self.end_tokens}, node={self.node.key})"


@dataclass(frozen=True, slots=True)
class Match:
    """Result of matching a chain against the index.

    ``kv_chunks``: leading chunks whose KV is cached; ``hit_chunks``: chunks the engine can
    skip (the deepest snapshot within the KV match, 0 if none); ``hit_node``: that node.
    """

    kv_chunks: int
    hit_chunks: int
    hit_node: Node | None


def bits(mask: int) -> list[int]:
    """The tiers set in ``mask`` (a node's ``kv_tiers`` / ``snap_tiers``: bit ``t`` = tier
    ``t``), ascending: every loop over them visits the tiers fast → slow."""
    out = []
    t = 0
    while mask:
        if mask & 1:
            out.append(t)
        mask >>= 1
        t += 1
    return out


def _lacks_kv(node: Node) -> bool:
    return not node.kv_tiers


class PrefixIndex:
    """Tree of chunk nodes keyed by chained chunk hash."""

    def __init__(self, chunk_tokens: int) -> None:
        if chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
        self.chunk_tokens = chunk_tokens
        self.root = Node(-1, None, -1)
        self.nodes: dict[int, Node] = {}
        self.sessions: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self.nodes)

    def __contains__(self, key: object) -> bool:
        return key in self.nodes

    def get(self, key: int) -> Node | None:
        return self.nodes.get(key)

    def end_tokens(self, node: Node) -> int:
        return (node.depth + 1) * self.chunk_tokens

    # ------------------------------------------------------------------ chains
    def insert_chain(self, keys: Sequence[int]) -> list[Node]:
        """Nodes for every chunk of ``keys``, creating missing ones (without content)."""
        parent = self.root
        out: list[Node] = []
        for i, key in enumerate(keys):
            node = self.nodes.get(key)
            if node is None:
                node = Node(key, parent, i)
                if parent.children is None:
                    parent.children = {}
                parent.children[key] = node
                self.nodes[key] = node
            elif node.parent is not parent:
                raise ChainError(
                    f"chunk hash {key} at position {i} is already cached under a different "
                    f"prefix (depth {node.depth}); hashes must be chained"
                )
            out.append(node)
            parent = node
        return out

    def walk(self, keys: Sequence[int]) -> list[Node]:
        """The existing nodes along ``keys`` (stops at the first unknown chunk)."""
        parent = self.root
        out: list[Node] = []
        for key in keys:
            node = self.nodes.get(key)
            if node is None or node.parent is not parent:
                break
            out.append(node)
            parent = node
        return out

    def match(self, keys: Sequence[int]) -> Match:
        return self.match_path(self.walk(keys))

    @staticmethod
    def match_path(path: Sequence[Node]) -> Match:
        """``match`` of a chain already walked (``walk``'s result): no second walk.

        KV is prefix-closed (module invariants), so the chunks of a chain that hold KV
        are a prefix of it: its end is found by bisection, and the hit by a scan back to
        the nearest snapshot, instead of a pass over the whole chain (every lookup and
        every request matches one).
        """
        kv = bisect_left(path, True, key=_lacks_kv)
        for i in range(kv - 1, -1, -1):
            node = path[i]
            if node.snap_tiers:
                return Match(kv, node.depth + 1, node)
        return Match(kv, 0, None)

    # ------------------------------------------------------------------ content
    def set_kv(self, node: Node, tiers: int, nbytes: int, now: float) -> None:
        if tiers == 0:
            raise ValueError("set_kv needs a non-empty tier mask; use clear_kv to remove")
        parent = node.parent
        assert parent is not None
        if parent is not self.root and not parent.kv_tiers:
            raise ChainError(
                f"KV of chunk {node.key} (depth {node.depth}) cannot be cached: the KV of "
                f"its parent chunk {parent.key} is not"
            )
        if not node.kv_tiers:
            parent.kv_children += 1
            node.kv_since = now
            node.access = max(node.access, now)
        node.kv_tiers = tiers
        node.kv_bytes = nbytes

    def clear_kv(self, node: Node) -> None:
        if not node.kv_tiers:
            return
        if node.kv_children:
            raise ChainError(f"chunk {node.key}: cannot drop KV while descendants hold KV")
        if node.snap_tiers:
            raise ChainError(f"chunk {node.key}: drop the snapshot before the KV")
        node.kv_tiers = 0
        node.kv_bytes = 0
        assert node.parent is not None
        node.parent.kv_children -= 1

    def set_snapshot(self, node: Node, tiers: int, nbytes: int, now: float) -> None:
        if tiers == 0:
            raise ValueError("set_snapshot needs a non-empty tier mask")
        if not node.kv_tiers:
            raise ChainError(
                f"snapshot at chunk {node.key} (depth {node.depth}) without its KV cannot be hit"
            )
        if not node.snap_tiers:
            node.snap_since = now
            node.access = max(node.access, now)
            node.used = max(node.used, now)
        node.snap_tiers = tiers
        node.snap_bytes = nbytes

    def clear_snapshot(self, node: Node) -> None:
        node.snap_tiers = 0
        node.snap_bytes = 0

    def prune(self, node: Node) -> None:
        """Remove ``node`` and empty ancestors if they hold nothing and have no children."""
        while node is not self.root and not node.kv_tiers and not node.children and not node.pins:
            parent = node.parent
            assert parent is not None
            if node.ends:
                # No ``rank_stamp`` reset: an end counts in the zone of the nearest
                # snapshot at or above it (``rank.expected_recompute``) by its session's
                # ``end_tokens`` alone, and ``node`` (without KV, so without a snapshot)
                # and ``parent`` lie in the same zone; at the root they lay in none.
                for session in node.ends:
                    session.node = parent
                if parent is not self.root:
                    if parent.ends is None:
                        parent.ends = set()
                    parent.ends |= node.ends
                else:
                    for session in node.ends:
                        session.node = self.root
            if parent.children is not None:
                del parent.children[node.key]
                if not parent.children:
                    parent.children = None
            del self.nodes[node.key]
            node.parent = None
            node = parent

    # ---------------------------------------------------------------- sessions
    def set_session(self, sid: str, node: Node, end_tokens: int) -> Session:
        """Point session ``sid`` at ``node`` with context length ``end_tokens``.

        Costs O(old depth + new depth): every node on both paths changes its hit density.
        """
        if end_tokens <= 0:
            raise ValueError(f"session {sid!r}: end_tokens must be positive")
        session = self.sessions.get(sid)
        if session is not None:
            self._add_weight(session, -1.0 / session.end_tokens, -1)
            self._detach_end(session)
            session.node = node
            session.end_tokens = end_tokens
        else:
            session = Session(sid, node, end_tokens)
            self.sessions[sid] = session
        if node is not self.root:
            if node.ends is None:
                node.ends = set()
            node.ends.add(session)
        self._add_weight(session, 1.0 / end_tokens, 1)
        return session

    def drop_session(self, sid: str) -> None:
        session = self.sessions.pop(sid, None)
        if session is None:
            return
        self._add_weight(session, -1.0 / session.end_tokens, -1)
        self._detach_end(session)

    def _detach_end(self, session: Session) -> None:
        ends = session.node.ends
        if ends is not None:
            ends.discard(session)
            if not ends:
                session.node.ends = None

    def _add_weight(self, session: Session, delta: float, count: int) -> None:
        node: Node | None = session.node
        while node is not None and node.depth >= 0:
            node.weight = max(0.0, node.weight + delta)
            node.passes += count
            # The queue is not re-ranked for this (O(depth) units): their ranks are no
            # longer trusted as current (``eviction`` NOTE 4). The units whose ``C``
            # reads this node's ``weight``, ``passes`` or ``ends`` are snapshots on
            # this path, so resetting the path resets all of them.
            node.rank_stamp = None
            node = node.parent

    # ---------------------------------------------------------------- checking
    def check(self) -> None:
        """Assert every invariant in the module docstring (O(n): a check, not for the hot path)."""
        for key, node in self.nodes.items():
            assert node.key == key
            parent = node.parent
            assert parent is not None and parent.children is not None
            assert parent.children.get(key) is node
            assert node.depth == parent.depth + 1
            if node.kv_tiers and parent is not self.root:
                assert parent.kv_tiers, f"KV gap above {node}"
            if node.snap_tiers:
                assert node.kv_tiers, f"snapshot without KV at {node}"
            kids = node.children.values() if node.children else ()
            assert node.kv_children == sum(1 for c in kids if c.kv_tiers), node
            assert node.kv_tiers or node.children or node.ends or node.pins, f"unpruned {node}"
        for session in self.sessions.values():
            assert session.node is self.root or self.nodes.get(session.node.key) is session.node
            if session.node is not self.root:
                assert session.node.ends is not None and session in session.node.ends
        passes: dict[Node, int] = {}
        for session in self.sessions.values():
            for node in session.node.path():
                passes[node] = passes.get(node, 0) + 1
        for node in self.nodes.values():
            assert node.passes == passes.get(node, 0), f"passes of {node}"
