"""Marconi (Pan et al., MLSys'25) on vLLM, GPU only: its radix tree, admission and eviction.

What is modelled (docs/design.md §6) and how it maps onto ``core.index.PrefixIndex``:

* **The radix tree.** Marconi's radix tree has one node per maximal token run without a
  branch or a checkpoint. We keep the chunk-level ``PrefixIndex`` (KV per chunk on the
  single ``gpu`` tier, a state bit per chunk end) and treat as a *Marconi node* every
  chunk that ends such a run: a chunk holding a state, a branch point (≥ 2 KV
  children) or a KV leaf. Its *edge* is the run above it up to the previous Marconi
  node, exactly ``core.rank.tail_chain``. Token runs are quantised to chunks (vLLM
  blocks), like every other row.
* **Admission (≤ 2 states per request).** The state at the sequence end (the prompt's
  last full chunk: traces hash prompt chunks only, as for every row) and, via
  *speculative insertion*, the state at the branch point: when the prompt's KV match
  ends inside an existing path (the last matched chunk has a KV child the prompt does
  not follow and no state yet), inserting the prompt would split that edge, so the
  state there is checkpointed during the prefill (the prefill passes it: the hit is
  never deeper than the divergence). The branch is found when the request is
  scheduled (``begin``) and saved when it completes.
* **Hits** need the state exactly at the hit position: the deepest state within the KV
  match (``PrefixIndex.match``), so hits land at sequence ends and branch points only.
  Only the node hit is refreshed (its recency set to the request's start); new nodes
  get the completion time.
* **Eviction** (when the ``gpu_bytes`` pool of KV + states is full): candidates are
  the Marconi nodes with ≤ 1 child, i.e. KV leaves (evicting one frees its edge's KV
  and its state) and single-child nodes with a state (evicting one frees the state;
  the edge merges into the child's). Nodes on a running request's path are locked.
  The victim minimises ``recency + α · flop_efficiency``, both min-max normalised over
  the current candidates (higher = keep), as in Marconi's ``radix_cache_hybrid.py``
  (its repository was not reachable from here; the formulas follow the audit in issue
  8 and docs/design.md §6):

  - recency = ``1 / (now − last access)`` (a node touched at ``now`` itself counts as
    ``_MIN_AGE_S`` old);
  - flop_efficiency = FLOPs saved by the node's own span over its parent, i.e.
    ``flops(L_node) − flops(L_parent)`` with ``L`` the prefix length in tokens at the
    node and at the Marconi node above its edge, divided by the memory of the whole
    prefix: the node's state plus the KV of all ``L_node`` tokens. A leaf without a
    state saves nothing (no hit can land there): efficiency 0.
* α is tuned by ``marconi_policy`` (once, from a replay); this module takes it as given.

Scale: one GPU pool holds at most a few thousand chunks, and Marconi nodes are far
fewer; the candidate scores are recomputed with one vectorised numpy pass per eviction
(min-max normalisation changes with every candidate set, so no fixed-key heap can keep
them ordered), O(candidates) in C.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ...core.index import Match, Node, PrefixIndex
from ...core.rank import tail_chain

__all__ = ["DEFAULT_FLOPS", "FlopModel", "MarconiCache", "MarconiHandle"]

_GPU = 1  # tier bitmask: Marconi runs on the GPU pool only
_MIN_AGE_S = 1e-6  # recency 1/(now − t) of a node touched at ``now``


@dataclass(frozen=True, slots=True)
class FlopModel:
    """Prefill FLOPs of an ``L``-token prefix: ``linear · L + pair · L²/2``.

    ``linear`` = 2 FLOPs per parameter per token (all projections, GDN and MLP layers);
    ``pair`` = FLOPs per causal (query, key) pair over all full-attention layers (QKᵀ
    and AV: 4 · layers · heads · head_dim). Only their ratio matters to Marconi: both
    scores are min-max normalised.
    """

    linear: float
    pair: float

    def flops(self, tokens: int) -> float:
        return self.linear * tokens + self.pair * tokens * tokens / 2.0


# Qwen3.5-9B: ~9e9 parameters; 8 full-attention layers × 16 query heads × head_dim 256.
DEFAULT_FLOPS = FlopModel(linear=2 * 9.0e9, pair=4 * 8 * 16 * 256)


class _Candidates:
    """Eviction candidates with their (last access, efficiency), in numpy arrays.

    O(1) insert / update / swap-remove by node; ``order`` ranks all of them at once.
    """

    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.slot: dict[Node, int] = {}
        self.rec = np.zeros(64)
        self.eff = np.zeros(64)

    def __len__(self) -> int:
        return len(self.nodes)

    def __contains__(self, node: object) -> bool:
        return node in self.slot

    def set(self, node: Node, rec: float, eff: float) -> None:
        i = self.slot.get(node)
        if i is None:
            i = len(self.nodes)
            if i == len(self.rec):
                self.rec = np.concatenate([self.rec, np.zeros(i)])
                self.eff = np.concatenate([self.eff, np.zeros(i)])
            self.nodes.append(node)
            self.slot[node] = i
        self.rec[i] = rec
        self.eff[i] = eff

    def touch(self, node: Node, rec: float) -> None:
        i = self.slot.get(node)
        if i is not None:
            self.rec[i] = rec

    def discard(self, node: Node) -> None:
        i = self.slot.pop(node, None)
        if i is None:
            return
        last = len(self.nodes) - 1
        if i != last:
            moved = self.nodes[last]
            self.nodes[i] = moved
            self.slot[moved] = i
            self.rec[i] = self.rec[last]
            self.eff[i] = self.eff[last]
        self.nodes.pop()

    def scores(self, alpha: float, now: float) -> np.ndarray:
        """``norm(1 / (now − access)) + α · norm(efficiency)``; lowest = evict first."""
        n = len(self.nodes)
        recency = 1.0 / np.maximum(now - self.rec[:n], _MIN_AGE_S)
        return _normalised(recency) + alpha * _normalised(self.eff[:n])


def _normalised(x: np.ndarray) -> np.ndarray:
    lo = x.min()
    span = x.max() - lo
    return (x - lo) / span if span > 0 else np.zeros_like(x)


@dataclass(slots=True)
class MarconiHandle:
    keys: tuple[int, ...]
    match: Match
    held: list[Node]
    branch: Node | None
    start: float


class MarconiCache:
    """One GPU pool of KV + states, Marconi's admission and FLOP-aware eviction."""

    def __init__(
        self,
        chunk_tokens: int,
        kv_chunk_bytes: int,
        state_bytes: int,
        capacity: int,
        alpha: float = 0.0,
        flops: FlopModel = DEFAULT_FLOPS,
    ) -> None:
        if kv_chunk_bytes <= 0 or state_bytes <= 0 or capacity < 0:
            raise ValueError("sizes must be positive and the capacity ≥ 0")
        self.index = PrefixIndex(chunk_tokens)
        self.kv_chunk_bytes = kv_chunk_bytes
        self.state_bytes = state_bytes
        self.capacity = capacity
        self.alpha = alpha
        self.flops = flops
        self.used = 0
        self.evictions = 0
        self.candidates = _Candidates()

    # ---------------------------------------------------------------- requests
    def begin(self, keys: Sequence[int], now: float) -> MarconiHandle:
        """Match ``keys``, refresh the node hit, lock the matched path, and find the
        branch point by speculative insertion."""
        keys = tuple(keys)
        path = self.index.walk(keys)
        match = self.index.match(keys)
        if match.hit_node is not None:
            match.hit_node.access = now
            self.candidates.touch(match.hit_node, now)
        m = match.kv_chunks
        branch = None
        if 0 < m < len(keys):
            last = path[m - 1]
            if last.kv_children and not last.snap_tiers:
                branch = last
        held = path[:m]
        for node in held:
            node.pins += 1
        return MarconiHandle(keys, match, held, branch, now)

    def complete(self, handle: MarconiHandle, now: float) -> int:
        """Store the prompt's new KV and its ≤ 2 states; returns the bytes written."""
        written = 0
        path = self.index.insert_chain(handle.keys)
        for node in path[len(handle.held) :]:
            node.pins += 1
        start = 0
        while start < len(path) and path[start].kv_tiers:
            start += 1
        stored = start
        # Room for the whole new segment at once (the victims are the same as chunk by
        # chunk: the new chunks are locked); chunk by chunk only if it does not all fit.
        whole = self._make_room((len(path) - start) * self.kv_chunk_bytes, now)
        for node in path[start:]:
            if not whole and not self._make_room(self.kv_chunk_bytes, now):
                break
            self.index.set_kv(node, _GPU, self.kv_chunk_bytes, now)
            self.used += self.kv_chunk_bytes
            written += self.kv_chunk_bytes
            stored += 1
        saved: list[Node] = []
        end = path[-1] if path and stored == len(path) else None
        for node in (handle.branch, end):
            if node is None or node.snap_tiers or not node.kv_tiers or node in saved:
                continue
            if self._make_room(self.state_bytes, now) and node.kv_tiers:
                self.index.set_snapshot(node, _GPU, self.state_bytes, now)
                self.used += self.state_bytes
                written += self.state_bytes
                node.access = now
                saved.append(node)
        for node in path:
            node.pins -= 1
        handle.held = []
        if stored < len(path):
            self.index.prune(path[-1])
        # Structure changed at the attachment point, at each new state and along the
        # new chunks (evictions while they were stored may have scored them as leaves).
        if 0 < start <= len(path):
            self._refresh_around(path[start - 1])
        for node in saved:
            self._refresh_around(node)
        cands = self.candidates
        for node in path[start : stored - 1]:  # single-child, stateless: not candidates
            cands.discard(node)
        if stored:
            self._refresh(path[stored - 1])
        return written

    # --------------------------------------------------------------- structure
    def _is_candidate(self, node: Node) -> bool:
        if not node.kv_tiers:
            return False
        return node.kv_children == 0 or (node.snap_tiers != 0 and node.kv_children == 1)

    def _refresh(self, node: Node) -> None:
        """(Re-)score chunk node ``node`` as a Marconi eviction candidate, or drop it."""
        if node.depth < 0 or self.index.nodes.get(node.key) is not node:
            self.candidates.discard(node)
            return
        if not self._is_candidate(node):
            self.candidates.discard(node)
            return
        self.candidates.set(node, node.access, self.efficiency(node))

    def efficiency(self, node: Node) -> float:
        """FLOPs saved by ``node``'s own span over its parent Marconi node, per byte of
        its whole prefix (state + KV of every token up to it)."""
        if not node.snap_tiers:
            return 0.0
        edge = 0
        for _ in tail_chain(node):
            edge += 1
        tokens = self.index.end_tokens(node)
        parent_tokens = tokens - edge * self.index.chunk_tokens
        saved = self.flops.flops(tokens) - self.flops.flops(parent_tokens)
        memory = node.snap_bytes + (node.depth + 1) * self.kv_chunk_bytes
        return saved / memory

    def _below(self, node: Node) -> Node:
        """The Marconi node whose edge contains ``node`` (``node`` or a descendant)."""
        while not node.snap_tiers and node.kv_children == 1 and node.children:
            node = next(c for c in node.children.values() if c.kv_tiers)
        return node

    def _refresh_around(self, node: Node) -> None:
        """``node`` gained/lost a child or a state: re-score it and the edges below it.

        With ≥ 3 KV children it was and stays a branch point either way, so the edges
        of its children did not change and the (possibly many) children are skipped.
        """
        if node.depth < 0 or self.index.nodes.get(node.key) is not node:
            return
        self._refresh(node)
        if node.children and node.kv_children <= 2:
            for child in node.children.values():
                if child.kv_tiers:
                    self._refresh(self._below(child))

    # ---------------------------------------------------------------- eviction
    def _make_room(self, need: int, now: float) -> bool:
        if need > self.capacity:
            return False
        while self.capacity - self.used < need:
            victim = self._victim(now)
            if victim is None:
                return False
            self._evict(victim)
        return True

    def _locked(self, node: Node) -> bool:
        if node.kv_children:
            return node.pins > 0
        return any(n.pins for n in tail_chain(node))  # a leaf takes its whole edge

    def victim_order(self, now: float) -> list[Node]:
        """Every unlocked candidate, first victim first (tests, debugging)."""
        scores = self.candidates.scores(self.alpha, now)
        order = sorted(range(len(scores)), key=lambda i: (scores[i], i))
        nodes = [self.candidates.nodes[i] for i in order]
        return [n for n in nodes if not self._locked(n)]

    def _victim(self, now: float) -> Node | None:
        cands = self.candidates
        if not len(cands):
            return None
        scores = cands.scores(self.alpha, now)
        for _ in range(len(cands)):
            i = int(np.argmin(scores))
            if not np.isfinite(scores[i]):
                return None
            node = cands.nodes[i]
            if not self._locked(node):
                return node
            scores[i] = np.inf
        return None

    def _evict(self, node: Node) -> None:
        self.evictions += 1
        self.candidates.discard(node)
        if node.kv_children:  # single-child node: only its state goes
            self.used -= node.snap_bytes
            self.index.clear_snapshot(node)
            child = next(c for c in node.children.values() if c.kv_tiers)  # type: ignore[union-attr]
            self._refresh(self._below(child))
            return
        chain = list(tail_chain(node))
        if node.snap_tiers:
            self.used -= node.snap_bytes
            self.index.clear_snapshot(node)
        for n in chain:  # leaf first: KV stays prefix-closed; none of them is a candidate
            self.used -= n.kv_bytes
            self.index.clear_kv(n)
        parent = chain[-1].parent
        self.index.prune(node)
        if parent is not None:
            self._refresh_around(parent)

    # ------------------------------------------------------------------ checks
    def check(self) -> None:
        """Byte accounting, capacity, and the candidate set (O(n); tests)."""
        self.index.check()
        counted = sum(n.kv_bytes + n.snap_bytes for n in self.index.nodes.values())
        assert counted == self.used, (counted, self.used)
        assert 0 <= self.used <= self.capacity, (self.used, self.capacity)
        live = {n for n in self.index.nodes.values() if self._is_candidate(n)}
        assert live == set(self.candidates.slot), "candidate set out of date"
        for node, i in self.candidates.slot.items():
            assert self.candidates.rec[i] == node.access, node
            assert np.isclose(self.candidates.eff[i], self.efficiency(node)), node
