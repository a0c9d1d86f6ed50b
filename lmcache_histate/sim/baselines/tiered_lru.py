"""Exclusive multi-tier LRU over the prefix index: the engine of the vLLM and SGLang rows.

Both engines cache the same two kinds of object as HiState, on the same chunk grid:
the attention KV of a chunk and a recurrent-state snapshot at a chunk's end, both held in
``core.index.PrefixIndex`` nodes (a hit = the deepest snapshot within the KV match, the
same rule as HiState and as LMCache's fold, docs/design.md §5.1). What differs is where the
objects live and who leaves first, and that is all this module decides:

* **Pools.** Each tier (``gpu`` → ``cpu`` → ``disk``, fastest first) has one byte pool
  per kind of object. vLLM keeps attention blocks and mamba state blocks in ONE block
  pool per tier (a state occupies blocks of the same page size), so its KV and state
  pools are the same pool; SGLang keeps separate KV and Mamba pools on the GPU and on the
  host, each with its own capacity and its own LRU list (``PoolSpec.kinds``).
* **LRU.** Every object has a priority = the time it was last released by a request
  (``IndexedHeap`` per tier and kind; the victim of a pool is the lowest priority over
  the heaps sharing it, KV first on a tie: a KV leaf takes its state with it). Objects in
  use by a request between ``acquire`` and ``admit`` are out of the heaps, as in-use
  blocks are out of vLLM's free queue.
* **Recency rules** (the same in both engines): a finished request releases every KV
  chunk of its prompt (hit, recomputed and new: the engine held them all) and only the
  ONE state it resumed from plus the states it saved; other states on the prefix keep
  their own age. Priorities are refreshed deepest chunk first, so that on equal times a
  parent always outranks (leaves after) its children: the queue is leaf-first, which is
  what vLLM's reverse-order freeing and SGLang's leaf-only eviction achieve.
* **Exclusive cascade.** An object evicted from a tier moves one tier down into the
  pool of its kind, which makes room only by evicting objects no more recent than it
  (one global recency order over the whole hierarchy); if that is not enough, or it is
  the last tier, it leaves the cache. A hit brings what it reads back to the fastest
  tier (its KV chunks and the state it resumed from), and recomputed chunks supersede
  their slower copies, so a prompt's KV ends up on the GPU after each request: the tree
  stays *tier-monotone* (a chunk is never on a faster tier than its parent), checked by
  ``check()``. This is the model the HiState rows use too (``sim/variants.py``:
  exclusive gpu→cpu→disk with demotion), so rows differ by policy, not by tiering.
  The real systems write through instead (vLLM's OffloadingConnector and LMCache copy
  every computed block to CPU/disk; SGLang HiCache's default ``write_through``): their
  lower tiers hold copies, so the distinct capacity is ~max(tier) rather than the sum.
  The exclusive model gives the baselines up to ``gpu_bytes`` more distinct capacity and
  no write traffic on the request path: a bias in their favour.
* **Dropping KV** drops the whole KV subtree below it (chunks past a gap can never be
  matched; by the recency order they are no more recent). ``drop_dead_tails`` also drops
  KV leaves left without a state (SGLang deletes such "tombstone" leaves at once; vLLM
  leaves the blocks to LRU, which is the default).

NOTE 1 (a saved state already cached lower down). A request that saves a state its
chunk already has on a slower tier moves that copy up instead of storing a second one.
The copy stays queued where it is while the fastest tier makes room, and that room
cascades down: demoted objects push out older ones on the slower tiers, and the copy,
older than what it makes room for, can be the one pushed off the last tier. The
request then stores its own copy in the room just made, so saving a state always
leaves it on the fastest tier, whatever the cascade did to the old copy.

Costs: a request costs O(prompt chunks · log n) (its whole prefix is re-queued, as
vLLM touches every block), an eviction O(log n) plus the objects it drops.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...core.eviction import IndexedHeap
from ...core.index import Match, Node, PrefixIndex
from ...core.rank import tail_chain

__all__ = ["KV", "STATE", "PoolSpec", "TieredLRU", "UseHandle"]

KV = 0
STATE = 1
_KIND_NAMES = ("kv", "state")


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """One byte pool: its tier's name, capacity, and the kinds of object it holds."""

    tier: str
    capacity: int
    kinds: tuple[int, ...] = (KV, STATE)

    def __post_init__(self) -> None:
        if self.capacity < 0:
            raise ValueError(f"pool on {self.tier!r}: capacity must be ≥ 0")
        if not self.kinds or any(k not in (KV, STATE) for k in self.kinds):
            raise ValueError(f"pool on {self.tier!r}: kinds must be a subset of (KV, STATE)")


@dataclass(slots=True)
class UseHandle:
    """What a request holds between ``acquire`` and ``admit``."""

    keys: tuple[int, ...]
    match: Match
    kv_nodes: list[Node]
    state_node: Node | None
    gpu_kv_chunks: int = 0  # leading matched chunks whose KV is on the fastest tier
    plan: Any = None  # the row's own bookkeeping between acquire and admit


def _tier_of(mask: int) -> int:
    return (mask & -mask).bit_length() - 1


class TieredLRU:
    """Prefix index + per-(tier, kind) LRU heaps + pool byte accounting."""

    def __init__(
        self,
        chunk_tokens: int,
        kv_chunk_bytes: int,
        state_bytes: int,
        pools: Sequence[PoolSpec],
        *,
        drop_dead_tails: bool = False,
    ) -> None:
        if kv_chunk_bytes <= 0 or state_bytes <= 0:
            raise ValueError("object sizes must be positive")
        self.index = PrefixIndex(chunk_tokens)
        self.sizes = (kv_chunk_bytes, state_bytes)
        self.pools = tuple(pools)
        self.tier_names: list[str] = []
        self._pool: list[list[int]] = []  # [tier][kind] -> pool index
        for p, spec in enumerate(self.pools):
            if spec.tier not in self.tier_names:
                self.tier_names.append(spec.tier)
                self._pool.append([-1, -1])
            t = self.tier_names.index(spec.tier)
            if t != len(self.tier_names) - 1:
                raise ValueError(f"pools of tier {spec.tier!r} must be listed together")
            for kind in spec.kinds:
                if self._pool[t][kind] >= 0:
                    raise ValueError(f"tier {spec.tier!r} has two {_KIND_NAMES[kind]} pools")
                self._pool[t][kind] = p
        for t, name in enumerate(self.tier_names):
            if min(self._pool[t]) < 0:
                raise ValueError(f"tier {name!r} needs a pool for both KV and states")
        self.drop_dead_tails = drop_dead_tails
        self.heaps = [(IndexedHeap[Node](), IndexedHeap[Node]()) for _ in self.tier_names]
        self.used = [0] * len(self.pools)
        self.written: Counter[str] = Counter()
        self.evictions: Counter[str] = Counter()  # "demote_<tier>" / "drop_<kind>"
        self._state_users: dict[Node, int] = {}

    # ----------------------------------------------------------------- queries
    def tier(self, node: Node, kind: int) -> int:
        return _tier_of(node.kv_tiers if kind == KV else node.snap_tiers)

    def free(self, pool: int) -> int:
        return self.pools[pool].capacity - self.used[pool]

    def match(self, keys: Sequence[int]) -> Match:
        return self.index.match(keys)

    # ------------------------------------------------------------ a request
    def acquire(self, keys: Sequence[int]) -> tuple[UseHandle, dict[str, int]]:
        """Match ``keys``, take the matched KV and the hit state out of the LRU.

        Returns the handle and the bytes the engine reads per tier to resume: the KV of
        every hit chunk and the one state at the hit.
        """
        keys = tuple(keys)
        path = self.index.walk(keys)
        match = self.index.match(keys)
        loads: Counter[str] = Counter()
        for node in path[: match.hit_chunks]:
            loads[self.tier_names[self.tier(node, KV)]] += node.kv_bytes
        hit = match.hit_node
        if hit is not None:
            loads[self.tier_names[self.tier(hit, STATE)]] += hit.snap_bytes
            if not self._state_users.get(hit):
                self.heaps[self.tier(hit, STATE)][STATE].discard(hit)
            self._state_users[hit] = self._state_users.get(hit, 0) + 1
        held = path[: match.kv_chunks]
        on_gpu = 0
        while on_gpu < len(held) and self.tier(held[on_gpu], KV) == 0:
            on_gpu += 1
        self._hold(held)
        return UseHandle(keys, match, held, hit, on_gpu), dict(loads)

    def _hold(self, nodes: Sequence[Node]) -> None:
        """A request holds ``nodes``: a held chunk is out of the LRU (vLLM: a block with
        ``ref_cnt > 0`` is out of the free queue; SGLang: ``lock_ref > 0``), whatever else
        holds it."""
        for node in nodes:
            if not node.pins and node.kv_tiers:
                self.heaps[self.tier(node, KV)][KV].discard(node)
            node.pins += 1

    def admit(self, handle: UseHandle, state_chunks: Sequence[int], now: float) -> dict[str, int]:
        """Release a finished request: every chunk of its prompt (``handle.keys``) ends
        up on the fastest tier (promoted, or stored new), a state is saved after each
        chunk count in ``state_chunks``, and everything it used is re-queued as most
        recent. Returns the bytes written per tier name (stores and moves into a tier).
        """
        before = Counter(self.written)
        path = self.index.insert_chain(handle.keys)
        # The chunks past the match are the request's own, held while the prompt is
        # placed. Another request may have stored one of them since ``acquire``: this
        # request computed its own copy and holds it (vLLM does not de-duplicate blocks,
        # ``block_pool.BlockHashToBlockMap`` NOTE #1; SGLang's request keeps its
        # ``req_to_token`` slots until it inserts), so it leaves the LRU like a hit.
        self._hold(path[len(handle.kv_nodes) :])
        stored = 0
        for node in path:
            ok = self._promote(node, KV) if node.kv_tiers else self._store(node, KV, now)
            if not ok:
                break
            stored += 1
        hit = handle.state_node
        if hit is not None:
            users = self._state_users.pop(hit) - 1
            if users:
                self._state_users[hit] = users
            elif hit.snap_tiers:
                self._touch_state(hit, now)
        for c in sorted(set(state_chunks)):
            node = path[c - 1] if 0 < c <= stored else None
            if node is None or node is hit or self._state_users.get(node):
                continue
            if not (node.snap_tiers and self._touch_state(node, now)):
                self._store(node, STATE, now)
        # Re-queue the prompt deepest first: on equal times the heap's insertion order
        # then evicts children before their parents.
        for node in reversed(path):
            node.pins -= 1
            if node.kv_tiers and not node.pins:
                heap = self.heaps[self.tier(node, KV)][KV]
                heap.discard(node)
                heap.set(node, now)
        if stored < len(path):
            self.index.prune(path[-1])
        handle.kv_nodes = []
        return {k: v - before[k] for k, v in self.written.items() if v != before[k]}

    # ------------------------------------------------------------- placement
    def _touch_state(self, node: Node, now: float) -> bool:
        """Bring an unheld cached state to the fastest tier and queue it as most recent;
        False if that dropped it. Its copy is queued on a slower tier while room is made
        above, so the cascade of that very room can push it off the last tier (NOTE 1);
        a saving request then stores its own copy (``admit``)."""
        self._promote(node, STATE)
        if not node.snap_tiers:
            return False
        heap = self.heaps[self.tier(node, STATE)][STATE]
        heap.discard(node)
        heap.set(node, now)
        return True

    def _store(self, node: Node, kind: int, now: float) -> bool:
        size = self.sizes[kind]
        if not self._make_room(self._pool[0][kind], size, None):
            return False
        if kind == KV:
            self.index.set_kv(node, 1, size, now)
        else:
            self.index.set_snapshot(node, 1, size, now)
        self.used[self._pool[0][kind]] += size
        self.written[self.tier_names[0]] += size
        if kind == STATE:
            self.heaps[0][STATE].set(node, now)
        return True

    def _promote(self, node: Node, kind: int) -> bool:
        src = self.tier(node, kind)
        if src == 0:
            return True
        if not self._make_room(self._pool[0][kind], self.sizes[kind], None):
            return False
        if not (node.kv_tiers if kind == KV else node.snap_tiers):
            return False  # making room dropped it (only possible for an unheld state)
        src = self.tier(node, kind)
        heap = self.heaps[src][kind]
        prio = heap.priority(node) if node in heap else None
        heap.discard(node)
        self._move(node, kind, src, 0, prio)
        return True

    def _move(self, node: Node, kind: int, src: int, dst: int, prio: float | None) -> None:
        """Move an object (already out of ``src``'s heap) to ``dst``; queue it there
        with ``prio`` unless it is held (None)."""
        size = node.kv_bytes if kind == KV else node.snap_bytes
        self.used[self._pool[src][kind]] -= size
        self.used[self._pool[dst][kind]] += size
        self.written[self.tier_names[dst]] += size
        if kind == KV:
            node.kv_tiers = 1 << dst
        else:
            node.snap_tiers = 1 << dst
        if prio is not None:
            self.heaps[dst][kind].set(node, prio)

    # -------------------------------------------------------------- eviction
    def _victim(self, pool: int) -> tuple[Node, int, float] | None:
        t = self.tier_names.index(self.pools[pool].tier)
        best: tuple[Node, int, float] | None = None
        for kind in (KV, STATE):
            if self._pool[t][kind] != pool:
                continue
            top = self.heaps[t][kind].peek()
            if top is not None and (best is None or top[1] < best[2]):
                best = (top[0], kind, top[1])
        return best

    def _make_room(self, pool: int, need: int, below: float | None) -> bool:
        """Evict from ``pool`` until ``need`` bytes are free, only objects whose
        priority is ≤ ``below`` (if given); False if that is not possible."""
        if need > self.pools[pool].capacity:
            return False
        while self.free(pool) < need:
            victim = self._victim(pool)
            if victim is None or (below is not None and victim[2] > below):
                return False
            self._evict(*victim)
        return True

    def _evict(self, node: Node, kind: int, prio: float) -> None:
        src = self.tier(node, kind)
        dst = src + 1
        self.heaps[src][kind].discard(node)
        if dst < len(self.tier_names):
            # Out of the heap while room is made below, so the cascade cannot pick it
            # again, and (KV) pinned against dead-tail drops; the recency bound keeps
            # its (more recent) ancestors in place.
            pin = int(kind == KV)
            node.pins += pin
            ok = self._make_room(self._pool[dst][kind], self.sizes[kind], prio)
            node.pins -= pin
            if not (node.kv_tiers if kind == KV else node.snap_tiers):
                return  # dropped by the cascade with the KV subtree holding it
            if ok:
                self._move(node, kind, src, dst, prio)
                self.evictions[f"demote_{self.tier_names[src]}"] += 1
                return
        if kind == KV:
            self._drop_kv(node)
        else:
            self._drop_state(node)

    def _drop_state(self, node: Node) -> None:
        t = self.tier(node, STATE)
        self.heaps[t][STATE].discard(node)
        self.used[self._pool[t][STATE]] -= node.snap_bytes
        self.index.clear_snapshot(node)
        self.evictions["drop_state"] += 1
        if self.drop_dead_tails and not node.kv_children:
            self._drop_tail(node)

    def _drop_kv(self, top: Node) -> None:
        parent = top.parent
        stack, order = [top], []
        while stack:  # the KV subtree, parents before children
            node = stack.pop()
            order.append(node)
            if node.children:
                stack.extend(c for c in node.children.values() if c.kv_tiers)
        for node in reversed(order):
            assert not node.pins, f"dropping held KV of {node}"
            if node.snap_tiers:
                self._drop_state_only(node)
            t = self.tier(node, KV)
            self.heaps[t][KV].discard(node)
            self.used[self._pool[t][KV]] -= node.kv_bytes
            self.index.clear_kv(node)
            self.evictions["drop_kv"] += 1
        for node in reversed(order):  # leaves first; pruned nodes lose their parent
            if node.parent is not None and not node.children:
                self.index.prune(node)
        if (
            self.drop_dead_tails
            and parent is not None
            and parent.depth >= 0
            and parent.kv_tiers
            and not parent.kv_children
            and not parent.snap_tiers
        ):
            self._drop_tail(parent)

    def _drop_state_only(self, node: Node) -> None:
        t = self.tier(node, STATE)
        self.heaps[t][STATE].discard(node)
        self.used[self._pool[t][STATE]] -= node.snap_bytes
        self.index.clear_snapshot(node)
        self._state_users.pop(node, None)

    def _drop_tail(self, leaf: Node) -> None:
        """Drop a KV leaf without state and its stateless single-child ancestors (the
        part no request holds: held nodes are a prefix-closed set, so they sit on top)."""
        if leaf.snap_tiers or leaf.pins:
            return
        chain = list(tail_chain(leaf))
        stop = next((i for i, n in enumerate(chain) if n.pins), len(chain))
        for node in chain[:stop]:
            t = self.tier(node, KV)
            self.heaps[t][KV].discard(node)
            self.used[self._pool[t][KV]] -= node.kv_bytes
            self.index.clear_kv(node)
            self.evictions["drop_kv"] += 1
        self.index.prune(leaf)

    # ----------------------------------------------------------------- checks
    def check(self) -> None:
        """Recount every pool, check capacities, queue membership, tier monotonicity."""
        self.index.check()
        counted = [0] * len(self.pools)
        for node in self.index.nodes.values():
            if node.kv_tiers:
                t = self.tier(node, KV)
                assert node.kv_tiers == 1 << t, f"KV of {node} on several tiers"
                counted[self._pool[t][KV]] += node.kv_bytes
                parent = node.parent
                if parent is not None and parent.depth >= 0:
                    assert self.tier(parent, KV) <= t, f"{node} is faster than its parent"
                queued = [node in h[KV] for h in self.heaps]
                assert queued == [not node.pins and i == t for i in range(len(self.heaps))]
            if node.snap_tiers:
                t = self.tier(node, STATE)
                assert node.snap_tiers == 1 << t, f"state of {node} on several tiers"
                counted[self._pool[t][STATE]] += node.snap_bytes
                queued = [node in h[STATE] for h in self.heaps]
                held = bool(self._state_users.get(node))
                assert queued == [not held and i == t for i in range(len(self.heaps))]
        assert counted == self.used, (counted, self.used)
        for spec, used in zip(self.pools, self.used, strict=True):
            assert 0 <= used <= spec.capacity, (spec, used)
        for t, (h_kv, h_state) in enumerate(self.heaps):
            for kind, heap in ((KV, h_kv), (STATE, h_state)):
                for node in heap:
                    assert self.index.nodes.get(node.key) is node, f"queued {node} not indexed"
                    mask = node.kv_tiers if kind == KV else node.snap_tiers
                    assert mask == 1 << t, f"{node} queued on {self.tier_names[t]} without it"
