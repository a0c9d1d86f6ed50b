"""Why ``IndexedHeap`` keeps plain floats in its ``heapq`` (``eviction`` NOTE 9): µs per pop.

Fills one list per entry shape with ``--entries`` random priorities in random memory order
(shuffled before ``heapify``, as entries pushed over a long run end up), then times
``--pops`` pops of each, the shapes interleaved over ``--rounds`` rounds so that load
swings hit them alike:

* ``float``  — the priority alone (what ``IndexedHeap._heap`` holds);
* ``tuple5`` — ``(priority, tie, order, version, key)``, the entry tuples an indexed heap
  commonly holds (every comparison compares the first items for equality, then for order, behind
  a pointer to each tuple).

Usage: ``python benchmarks/heap_pops.py [--entries 372000] [--pops 100000] [--rounds 3]``
"""

from __future__ import annotations

import argparse
import heapq
import random
import time


def fill(shape: str, n: int, rng: random.Random) -> list:
    if shape == "float":
        heap: list = [rng.random() * 1e6 for _ in range(n)]
    else:
        heap = [(rng.random() * 1e6, 0, i, i, object()) for i in range(n)]
    rng.shuffle(heap)
    heapq.heapify(heap)
    return heap


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, default=372_000)
    ap.add_argument("--pops", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    rng = random.Random(0)
    shapes = ("float", "tuple5")
    spent = dict.fromkeys(shapes, 0.0)
    for _ in range(args.rounds):
        for shape in shapes:
            heap = fill(shape, args.entries, rng)
            pop = heapq.heappop
            start = time.perf_counter()
            for _ in range(args.pops):
                pop(heap)
            spent[shape] += time.perf_counter() - start
    print(f"{args.entries:,} entries, {args.pops:,} pops x {args.rounds} rounds\n")
    print("| entry | µs per pop |\n|---|---:|")
    for shape in shapes:
        print(f"| {shape} | {spent[shape] / (args.pops * args.rounds) * 1e6:.2f} |")


if __name__ == "__main__":
    main()
