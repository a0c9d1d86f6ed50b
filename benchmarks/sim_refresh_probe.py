"""What the refresh scope changes in one replay: drops, resumes and the requests that differ.

Replays one repeat of one pressure-matrix cell (``benchmarks/sim_pressure.py``'s set-up
and jitter) through HiState rows and ``unlimited``, and for each HiState row prints

* **snapshots dropped from the cache**: intermediate ones (dropped alone, their KV
  staying below) and those of bundles, by how long the node had gone unread (``now −
  access``: under refresh-all a pass counts as a read) — under 1 min, 1–4 min (a session
  in a think gap, capped at 180 s by the config), 4 min and more;
* **resumes from intermediate snapshots** (a hit whose snapshot has KV below it): how
  many, how many from the *head* of their prefix (no snapshot above it on the path), and
  the median time since the snapshot was last passed (``access``) and since ``used``
  (written when it is stored, and under ``refresh_used`` when it is resumed from), read
  before the hit refreshes it;
* against the first row: the requests whose hit differs by ≥ 5 % of the prompt, split
  into *end hits* (the other row resumes within 10 % of where the session's previous
  request ended) and *internal* ones (a rewrite resuming inside earlier context), with
  the net hit tokens;
* the sessions' re-access gaps (what ``τ`` averages) and the chance that a session unread
  for 150 s (most of the config's 180 s think cap) comes back, against the score's.

The probe wraps a row's policy (the simulator's ``Policy`` protocol) and its count of
the core's placement events; it changes no decision (the replay's hits equal the plain
run's, which the probe asserts).

Usage: ``nice -n 10 python benchmarks/sim_refresh_probe.py --cell 48:0.25 [--repeat 0]
[--rows histate,histate-refresh-used]``.
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from lmcache_histate.core.cache import PlacementEvent
from lmcache_histate.core.index import Node
from lmcache_histate.core.tiers import SNAPSHOT
from lmcache_histate.sim.capture import Capture, capacity_of, capture_of
from lmcache_histate.sim.config import load_setup
from lmcache_histate.sim.load import with_target_load
from lmcache_histate.sim.policy import HiStatePolicy, Lookup
from lmcache_histate.sim.repeats import DEFAULT_JITTER, jitter_trace
from lmcache_histate.sim.report import REFERENCE
from lmcache_histate.sim.runner import load_sim_trace, policy_factories, run_policies
from lmcache_histate.sim.server import RequestResult
from lmcache_histate.sim.trace_model import Request

AGE_BINS = ((60.0, "< 1 min"), (240.0, "1–4 min"), (float("inf"), "≥ 4 min"))


def _age_bin(age: float) -> str:
    return next(name for limit, name in AGE_BINS if age < limit)


def _head(node: Node) -> bool:
    """No snapshot above ``node`` on its path."""
    p = node.parent
    while p is not None and p.depth >= 0 and not p.snap_tiers:
        p = p.parent
    return p is None or p.depth < 0


def _gaps(results: list[RequestResult], tau: float, idle: float = 150.0) -> str:
    """A line on the sessions' re-access gaps (one request's start to the next's: the samples of
    ``τ``), and how likely a session unread for ``idle`` seconds is to return: gaps
    longer than ``idle`` over those plus the sessions' final idles (they never return),
    against the score's ``exp(−idle/τ)``."""
    starts: dict[str, list[tuple[int, float]]] = {}
    for r in results:
        starts.setdefault(r.session_id, []).append((r.index, r.start))
    gaps = []
    for seq in starts.values():
        seq.sort()
        gaps += [b[1] - a[1] for a, b in itertools.pairwise(seq)]
    longer = sum(1 for g in gaps if g > idle)
    back = longer / (longer + len(starts))
    return (f"re-access gaps: {len(gaps)}, mean {statistics.mean(gaps):.0f} s, median "
            f"{statistics.median(gaps):.0f} s, over {idle:.0f} s {longer}; a session unread "
            f"{idle:.0f} s returns with probability {back:.2f} "
            f"(exp(−{idle:.0f}/τ) = {math.exp(-idle / tau):.2f})")


@dataclass
class Probe:
    """A HiState row's policy, with what it dropped and resumed from recorded."""

    inner: HiStatePolicy
    now: float = 0.0
    drops: Counter[tuple[str, str]] = field(default_factory=Counter)
    resumes: list[tuple[bool, float, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.name = self.inner.name
        counter = self.inner.counter
        plain = counter.count

        def count(events: Iterable[PlacementEvent]) -> None:
            events = list(events)
            for event in events:
                if event[0] == "dropped" and event[2] == SNAPSHOT:
                    kind = "intermediate" if event[8] else "bundle"
                    self.drops[(kind, _age_bin(self.now - event[7]))] += 1
            plain(events)

        counter.count = count  # type: ignore[method-assign]

    def begin(self, request: Request, now: float) -> Lookup:
        self.now = now
        match = self.inner.cache.lookup(request.chunk_hashes)
        node = match.hit_node
        if node is not None and node.kv_children:
            self.resumes.append((_head(node), now - node.access, now - node.used))
        return self.inner.begin(request, now)

    def complete(self, request: Request, lookup: Lookup, now: float) -> dict[str, int]:
        self.now = now
        return self.inner.complete(request, lookup, now)

    def stats(self) -> dict[str, float]:
        return self.inner.stats()

    # The simulator reads the prefill capture and capacity of a HiState row from its
    # policy (``sim.capture``): the wrapped row's own.
    def capture(self, request: Request, lookup: Lookup) -> Capture:
        return capture_of(self.inner, request, lookup)

    def capacity_bytes(self) -> float:
        return capacity_of(self.inner)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="../shared/traces/weka-cc")
    ap.add_argument("--max-input-tokens", type=int, default=100_000)
    ap.add_argument("--config", default="configs/sim-paper-load.yaml")
    ap.add_argument("--cell", default="48:0.25", help="SESSIONS:FACTOR")
    ap.add_argument("--repeat", type=int, default=0)
    ap.add_argument("--jitter", type=float, default=DEFAULT_JITTER)
    ap.add_argument("--rows", default="histate,histate-refresh-used")
    args = ap.parse_args()
    base = load_setup(args.config)
    sessions, factor = args.cell.split(":")
    setup = base.with_(max_sessions=int(sessions), cpu_bytes=int(base.cpu_bytes * float(factor)),
                       disk_bytes=int(base.disk_bytes * float(factor)))
    loaded = load_sim_trace(args.trace, base, args.max_input_tokens)
    setup, _ = with_target_load(loaded, setup)  # the config's load rule (sim/load.py)
    trace = jitter_trace(loaded, setup.seed, args.repeat, args.jitter)
    available = policy_factories(setup)
    rows = args.rows.split(",")
    probes: dict[str, Probe] = {}

    def probed(name: str) -> Any:
        def make() -> Probe:
            probes[name] = Probe(available[name]())
            return probes[name]
        return make

    factories = {name: probed(name) for name in rows}
    factories[REFERENCE] = available[REFERENCE]
    runs = run_policies(trace, setup, factories)
    plain = run_policies(trace, setup, {name: available[name] for name in rows})
    for name in rows:
        hits = [(r.key, r.hit_tokens) for r in runs[name].results]
        assert hits == [(r.key, r.hit_tokens) for r in plain[name].results], name
    print(f"cell {args.cell}, repeat {args.repeat}")
    for name in rows:
        p = probes[name]
        drops = ", ".join(f"{kind} {age} {p.drops[(kind, age)]}"
                          for kind in ("intermediate", "bundle") for _, age in AGE_BINS)
        heads = sum(1 for head, _, _ in p.resumes if head)
        print(f"{name}: tau {p.stats()['tau']:.1f} s; snapshots dropped: {drops}")
        if p.resumes:
            print(f"  resumes from intermediate snapshots {len(p.resumes)}, from the head "
                  f"{heads}; median s since passed "
                  f"{statistics.median(r[1] for r in p.resumes):.0f}, since stored/used "
                  f"{statistics.median(r[2] for r in p.resumes):.0f}")
    first = {r.key: r for r in runs[rows[0]].results}
    print(_gaps(runs[rows[0]].results, probes[rows[0]].stats()["tau"]))
    for name in rows[1:]:
        tally: Counter[tuple[str, str]] = Counter()
        tokens = 0
        for r in runs[name].results:
            a = first[r.key]
            if abs(r.hit_tokens - a.hit_tokens) < 0.05 * r.input_tokens:
                continue
            prev = first.get((r.session_id, r.index - 1))
            at = max(r.hit_tokens, a.hit_tokens)
            where = "end" if prev is not None and at >= 0.9 * prev.input_tokens else "internal"
            tally[(where, name if r.hit_tokens > a.hit_tokens else rows[0])] += 1
            tokens += r.hit_tokens - a.hit_tokens
        print(f"{name} vs {rows[0]}: requests hitting ≥ 5 % more, by kind: "
              + ", ".join(f"{where} {who} {n}" for (where, who), n in sorted(tally.items()))
              + f"; net hit tokens {tokens:+,}")


if __name__ == "__main__":
    main()
