"""Listeners that record what they are told: the core's byte movements (``EventLog``) and
the disk tier's reports (``DiskReports``)."""

from __future__ import annotations

from typing import Any

from lmcache_histate.core.index import Node


class EventLog:
    """``events``: ``(what, chunk key, part, tier)`` in call order.

    ``what`` is ``moved`` (tier = destination), ``stored`` (tier = where) or ``dropped``
    (tier = the bitmask of tiers the part left).
    """

    def __init__(self) -> None:
        self.events: list[tuple[str, int, str, int]] = []

    def moved(self, node: Node, part: str, src: int, dst: int) -> None:
        self.events.append(("moved", node.key, part, dst))

    def stored(self, node: Node, part: str, tier: int) -> None:
        self.events.append(("stored", node.key, part, tier))

    def dropped(self, node: Node, part: str, tiers: int) -> None:
        self.events.append(("dropped", node.key, part, tiers))

    def take(self) -> list[tuple[str, int, str, int]]:
        """The events so far; the log starts empty again."""
        out, self.events = self.events, []
        return out


class DiskReports:
    """A ``DiskTierListener`` that records each report: ``written`` holds ``(stored,
    failed)`` per write batch, ``lost`` the keys of lost files, ``capacities`` each new
    capacity, in call order."""

    def __init__(self) -> None:
        self.written: list[tuple[list[Any], list[Any]]] = []
        self.lost: list[Any] = []
        self.capacities: list[int] = []

    def on_disk_written(self, stored: list[Any], failed: list[Any]) -> None:
        self.written.append((list(stored), list(failed)))

    def on_disk_lost(self, keys: list[Any]) -> None:
        self.lost.extend(keys)

    def on_disk_capacity(self, capacity_bytes: int) -> None:
        self.capacities.append(capacity_bytes)
